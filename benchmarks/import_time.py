"""What `import raydp_train` costs (issue 29: under 0.3 s, no torch and no Ray), against a bare
interpreter, `import pydantic`, `import torch` and `import ray` measured the same way: each
statement in 7 fresh processes, interleaved, the median wall time of the process reported.

    .venv/bin/python benchmarks/import_time.py              (about a minute)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

RESULTS = Path(__file__).with_name("RESULTS.md")
REPEATS = 7
STATEMENTS = {
    "python -c pass (the floor)": "pass",
    "import raydp_train": "import raydp_train",
    "raydp_train.Pipeline.from_yaml(quickstart)":
        "import raydp_train as rt; rt.Pipeline.from_yaml('pipelines/quickstart.yaml')",
    "import pydantic": "import pydantic",
    "import torch": "import torch",
    "import ray": "import ray",
}
TITLE = "## `import raydp_train` (benchmarks/import_time.py)"


def wall(statement: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True,
                   cwd=Path(__file__).parents[1])
    return time.perf_counter() - started


def main() -> None:
    load = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(REPEATS):
        for name, statement in STATEMENTS.items():
            times[name].append(wall(statement))
    floor = statistics.median(times["python -c pass (the floor)"])
    lines = [TITLE, "",
             (f"Each statement in {REPEATS} fresh processes, interleaved; the median wall time "
             f"of the whole process, and that less the bare interpreter's; {os.cpu_count()} "
             f"cores, 1-minute load average {load:.1f} before the runs."), "",
             "| statement | process | above the floor |", "|---|---:|---:|"]
    for name, measured in times.items():
        median = statistics.median(measured)
        lines.append(f"| `{name}` | {median:.3f} s | {median - floor:.3f} s |")
    raydp = statistics.median(times["import raydp_train"]) - floor
    lines += ["", (f"- **`import raydp_train`: {raydp:.3f} s above the interpreter "
              f"({'met' if raydp < 0.3 else 'NOT met'}: under 0.3 s).** The package's names "
              "load on first use (`__init__.py`), so neither torch nor Ray is imported "
              "(tests/test_api.py asserts it); the first use of `rt.Pipeline` imports "
              "pydantic and the schema.")]
    write_section(RESULTS, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
