import sys

from raydp_train.cli import main

sys.exit(main())
