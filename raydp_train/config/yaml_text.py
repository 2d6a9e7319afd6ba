"""YAML read with bounds: a pipeline is a small document, so anything far larger, deeper or
more repetitive than one is refused in well under a second, with the limit it passed.

PyYAML's safe loader builds aliases as shared objects, so a "billion laughs" document loads
fast and only explodes when something walks it; its composer recurses once per nesting level,
so a few thousand levels end in a RecursionError. Both are caught here, before any walk. A key
given twice in one mapping is an error too (PyYAML keeps the last silently).
"""

from __future__ import annotations

import yaml

MAX_BYTES = 1_000_000
MAX_DEPTH = 32  # the deepest shipped pipeline nests 6 levels
MAX_NODES = 100_000  # values after every alias is expanded; the largest shipped pipeline: ~200


class YamlLimitError(ValueError):
    """The text passes one of the bounds above; the message names it."""


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if (not isinstance(key_node, yaml.ScalarNode)
                    or key_node.tag == "tag:yaml.org,2002:merge"):  # `<<`: keys may repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_bounded(text: str):
    """`yaml.safe_load(text)` within the bounds; YamlLimitError or yaml.YAMLError otherwise."""
    if len(text.encode(errors="replace")) > MAX_BYTES:
        raise YamlLimitError(f"the YAML text is larger than {MAX_BYTES:,} bytes")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise YamlLimitError(f"the YAML nests deeper than {MAX_DEPTH} levels") from None
    _check_shape(value)
    return value


def _check_shape(value) -> None:
    """Height and expanded size, each shared object measured once (an explicit stack, so the
    walk itself cannot recurse too deep)."""
    measured: dict[int, tuple[int, int]] = {}  # id -> (values after expansion, levels)
    visiting: set[int] = set()
    stack = [(value, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)) or (id(node) in measured and not children_done):
            continue
        children = [c for c in (node.values() if isinstance(node, dict) else node)
                    if isinstance(c, (dict, list))]
        if not children_done:
            if id(node) in visiting:
                raise YamlLimitError("the YAML refers to itself (an alias inside its anchor)")
            visiting.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children)
            continue
        visiting.discard(id(node))
        scalars = len(node) - len(children)
        size = 1 + scalars + sum(measured[id(child)][0] for child in children)
        levels = 1 + max((measured[id(child)][1] for child in children), default=0)
        if levels > MAX_DEPTH:
            raise YamlLimitError(f"the YAML nests deeper than {MAX_DEPTH} levels")
        if size > MAX_NODES:
            raise YamlLimitError(f"the YAML expands to more than {MAX_NODES:,} values "
                                 "(aliases repeating aliases)")
        measured[id(node)] = (size, levels)
