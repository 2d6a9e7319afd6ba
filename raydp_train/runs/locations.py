"""Where a run writes: `run.output_dir` and `budget.ledger` must name the same place for every
process that uses them, however the product is run.

`ray job submit --working-dir DIR` runs the entrypoint inside Ray's per-job copy of DIR
(`<session>/runtime_resources/working_dir_files/_ray_pkg_<content hash>/`). A relative path
there lands in a temporary folder that changes with every edit of any file: the next job would
start a fresh budget from a fresh ledger, and the run record would vanish with the session. So
inside such a copy a relative path is refused, before anything is spent, with the absolute
path it should have been.

On a cluster the ledger is the ONE global budget only if every driver and node sees the same
one: a relative path, or a folder on one machine's own disk, is warned about.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from raydp_train.budget.ledger import check_ledger_location
from raydp_train.config.pipeline import Pipeline, PipelineError

# Set by Ray's job server for the entrypoint of a submitted job: the job's runtime env.
_JOB_CONFIG_VARIABLE = "RAY_JOB_CONFIG_JSON_ENV_VAR"
_WORKING_DIR_COPIES = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep


# File systems that several machines mount as one (anything else is taken as node-local).
_SHARED_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre",
                       "gpfs", "beegfs", "9p", "virtiofs", "afs", "orangefs"}


def check_locations(pipeline: Pipeline, source: str) -> None:
    """Refuse output and ledger locations that would not mean the same place everywhere."""
    problems = [_relative_in_job_copy(field, value) or _not_a_folder(field, value)
                for field, value in _written_paths(pipeline)]
    if pipeline.budget is not None:
        check_ledger_location(pipeline.budget.ledger)
    problems = [problem for problem in problems if problem]
    if problems:
        raise PipelineError(source, problems)


def warn_if_not_shared(pipeline: Pipeline, address: str | None) -> None:
    """Print a warning line for each written path a cluster's other nodes and drivers would
    not share (once the cluster answered: a dead address is an error of its own)."""
    for warning in cluster_warnings(pipeline, address):
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def cluster_warnings(pipeline: Pipeline, address: str | None) -> list[str]:
    """When joining a cluster (an address, or a submitted job): each written path that is
    relative or on this machine's own disk, one line each."""
    if address in (None, "", "local") and _JOB_CONFIG_VARIABLE not in os.environ:
        return []
    warnings = []
    for field, value in _written_paths(pipeline):
        if "://" in value:
            continue
        if not Path(value).is_absolute():
            warnings.append(f"{field}: '{value}' is relative to the folder this command runs "
                            "in; on a cluster every driver must name the same place: give an "
                            "absolute path on shared storage, or a URI")
        elif (kind := _filesystem_type(value)) is not None and not _shared(kind):
            warnings.append(f"{field}: {value} is on this machine's own disk ({kind}); the "
                            "other nodes and drivers of a cluster would not see it"
                            + (" and would each grant the whole budget"
                               if field == "budget.ledger" else "")
                            + ": put it on storage they all mount (NFS, ...) or a URI")
    return warnings


def _shared(kind: str) -> bool:
    return kind in _SHARED_FILESYSTEMS or kind.startswith("fuse")


def _filesystem_type(path: str, mounts: str = "/proc/mounts") -> str | None:
    """The type of the file system holding `path` (its nearest existing folder), from the
    mount table; None where that cannot be read."""
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent
    target = target.resolve()
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])  # \040: " "
        inside = target == Path(mount) or Path(mount) in target.parents
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def job_working_dir_copy() -> str | None:
    """The Ray job working-directory copy this process runs in, or None."""
    cwd = os.getcwd()
    if _WORKING_DIR_COPIES in cwd + os.sep:
        return cwd
    try:
        runtime_env = json.loads(os.environ.get(_JOB_CONFIG_VARIABLE, "{}")).get("runtime_env")
    except json.JSONDecodeError:
        return None
    return cwd if (runtime_env or {}).get("working_dir") else None


def _written_paths(pipeline: Pipeline) -> list[tuple[str, str]]:
    paths = [("run.output_dir", pipeline.run.output_dir)]
    if pipeline.budget is not None:
        paths.append(("budget.ledger", pipeline.budget.ledger))
    return paths


def _not_a_folder(field: str, value: str) -> str | None:
    if "://" in value:
        return None
    try:
        if Path(value).exists() and not Path(value).is_dir():
            return f"{field}: {Path(value).absolute()} is a file, not a folder"
    except OSError as error:  # e.g. a name longer than the file system allows
        return f"{field}: cannot use {value[:80]!r}: {error.strerror or error}"
    return None


def _relative_in_job_copy(field: str, value: str) -> str | None:
    if "://" in value or Path(value).is_absolute():
        return None
    copy = job_working_dir_copy()
    if copy is None:
        return None
    return (f"{field}: '{value}' is relative, and this Ray job runs in its temporary "
            f"working-directory copy {copy}, which changes with every edited file: give an "
            f"absolute path or a URI, e.g. --set {field}=$PWD/{value} in the submitting shell")
