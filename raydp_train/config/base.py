"""Building blocks of the config schema: the strict section base class and shared checks."""

from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from raydp_train.config.errors import FieldProblem, show


class Section(BaseModel):
    # A typo in a key must fail loudly, not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, raw: Any) -> Any:
        # Pydantic would quietly read `epochs: yes` as 1: only bool fields take booleans.
        for key, value in raw.items() if isinstance(raw, dict) else ():
            field = cls.model_fields.get(key)
            if isinstance(value, bool) and field is not None and not _takes_bool(field.annotation):
                raise FieldProblem(f"must not be a boolean, got {show(value)} "
                                    "(YAML reads yes/no/on/off as true/false)", key)
        return raw


def _takes_bool(annotation: Any) -> bool:
    """bool, or a union with bool in it (`bool | None`)."""
    return annotation is bool or bool in typing.get_args(annotation)


def exactly_one(section: BaseModel, a: str, b: str, field: str | None) -> None:
    n_set = sum(getattr(section, k) is not None for k in (a, b))
    if n_set != 1:
        got = "both" if n_set == 2 else "neither"
        raise FieldProblem(f"set exactly one of {a} or {b} (got {got})", field)


# A name becomes a folder with a date added (a run's) or files named after it (a budget's
# witness and its lock): short enough that each stays within a file name's 255 bytes.
MAX_NAME = 200
MAX_COMPONENT_BYTES = 255  # one file name (NAME_MAX of ext4, xfs, btrfs, NFS)
MAX_PATH_BYTES = 4095  # a whole path (PATH_MAX, its terminating zero excluded)


def _safe_name(value: str) -> str:
    # Names become directories, Ray job names and actor names.
    if len(value) > MAX_NAME:
        raise FieldProblem(f"is {len(value)} characters long, at most {MAX_NAME} (it names "
                           f"folders and files: {value[:24]}...)")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise FieldProblem(f"may contain only letters, digits, '_', '.' and '-', got {value!r}")
    if value.startswith("."):  # '.' and '..' name no folder of their own; '.x' hides one
        raise FieldProblem(f"may not start with '.', got {value!r}")
    return value


SafeName = Annotated[str, AfterValidator(_safe_name)]


def bounded_path(value: str) -> str:
    """A local path whose every component fits a file name (255 bytes) and which fits
    PATH_MAX; a URI (s3://...) is left to its store."""
    if "://" in value:
        return value
    encoded = os.fsencode(value)
    if len(encoded) > MAX_PATH_BYTES:
        raise FieldProblem(f"is {len(encoded)} bytes long, over the {MAX_PATH_BYTES} a path "
                           f"may have: {value[:40]}...")
    for component in encoded.split(b"/"):
        if len(component) > MAX_COMPONENT_BYTES:
            shown = os.fsdecode(component[:24])
            raise FieldProblem(f"has a component of {len(component)} bytes ({shown}...), over "
                               f"the {MAX_COMPONENT_BYTES} a file name may have")
    return value


# A place read from: a file or folder named by a path that the file system can hold.
ReadPath = Annotated[str, AfterValidator(bounded_path)]
# Seeds as numpy's and scikit-learn's generators take them.
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
# A place written to: `~` means the home folder, as in a shell (not a folder named '~').
WrittenPath = Annotated[str, AfterValidator(os.path.expanduser), AfterValidator(bounded_path)]

FUNCTION_SPEC = r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$"  # "file.py:function", "package.module:function"
# A function in the user's code: its file (or module) part a path the file system can hold.
FunctionSpec = Annotated[str, Field(pattern=FUNCTION_SPEC, max_length=4096),
                         AfterValidator(lambda spec: bounded_path(spec.rpartition(":")[0])
                                        and spec)]
