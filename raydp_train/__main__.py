import sys

from raydp_train.commands.cli import main

if __name__ == "__main__":  # `python -m raydp_train`; importing the module runs nothing
    sys.exit(main())
