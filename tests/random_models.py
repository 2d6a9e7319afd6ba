"""A seeded generator of small random models for the clipping engine's soundness suite.

A model is a program: a list of operations on "registers" (activations [B, a, b] or
[B, c, h, w]), rendered as Python source and built with exec, so that a failure prints the
exact model that failed. Operations: Linear (also called a second time), Conv1d over tokens
or over the raw axes, Conv2d (stride, padding, dilation, groups), Embedding of token ids,
LayerNorm / RMSNorm / GroupNorm, activations (in place too), residual adds (in place too),
padding masks, shared inputs (any register may be read again), branches that never reach the
loss, frozen parameters, shared parameters of every kind (a weight, a bias, a norm's scale, an
embedding, a kernel; between two layers of one kind, or a Linear's bias as a LayerNorm's),
forward hooks and pre-hooks that change a layer's input or output, functional uses of another
layer's weight (F.linear, a custom autograd.Function, a use behind data-dependent control
flow) and weight_norm re-parametrizations.
A functional use whose gradient reaches the loss must be refused (otherwise the numbers must be
exact), a re-parametrized layer always; everything else must be exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

MAX_TOKENS = 8  # ids and mask length; every register's token axis is at most this


@dataclass(frozen=True)
class Op:
    line: str  # forward source, with {r} placeholders already filled
    reads: tuple[int, ...] = ()  # registers read
    writes: int | None = None  # register created (None: in place or nothing new)
    modifies: int | None = None  # register changed in place
    module: str | None = None  # module created by this op
    module_source: str | None = None  # its constructor
    uses: tuple[str, ...] = ()  # existing modules this op calls or whose weight it takes
    refusal: str | None = None  # "functional" or "reparametrized" (see expected_refusals)
    tied: bool = False  # the new module shares the weight of uses[0] (tied weights)
    shares: tuple[tuple[str, str], ...] = ()  # (own attribute, uses[0]'s attribute) shared
    hook: str | None = None  # a hook registered on the module uses[0]


@dataclass
class Program:
    seed: int
    batch_size: int
    vocab: int
    num_classes: int
    shapes: dict[int, tuple[int, ...]]  # register -> shape without the batch axis
    ops: list[Op]
    frozen: frozenset[str] = frozenset()  # "m3.weight", ...
    dropped_from_head: frozenset[int] = frozenset()
    # (module, attribute, other, other's attribute): module.attribute = other.attribute
    ties: tuple[tuple[str, str, str, str], ...] = ()

    def module_names(self) -> list[str]:
        return [op.module for op in self.ops if op.module]

    def head_registers(self) -> list[int]:
        read = {r for op in self.ops for r in op.reads}
        written = [op.writes for op in self.ops if op.writes is not None]
        dangling = [r for r in written if r not in read and r not in self.dropped_from_head]
        return dangling or written[-1:] or [0]

    def expected_refusals(self) -> set[str]:
        """The refusals a correct engine may give: functional uses of trained weights (a shared
        parameter is frozen under either of its names); re-parametrized layers always."""
        frozen = set(self.frozen)
        for a, attribute, b, other in self.ties:  # one tensor under two names
            if {f"{a}.{attribute}", f"{b}.{other}"} & frozen:
                frozen |= {f"{a}.{attribute}", f"{b}.{other}"}
        refusals = set()
        for op in self.ops:
            if op.refusal == "reparametrized":
                refusals.add(op.refusal)
            elif op.refusal:
                names = {f"{op.uses[0]}.weight"} | ({f"{op.module}.weight"} if op.module else set())
                if not names & frozen:
                    refusals.add(op.refusal)
        return refusals

    def source(self) -> str:
        lines = [
            "import torch",
            "import torch.nn.functional as F",
            "from torch import nn",
            "",
            "class Matmul(torch.autograd.Function):",
            "    @staticmethod",
            "    def forward(ctx, x, w):",
            "        ctx.save_for_backward(x, w)",
            "        return x @ w.t()",
            "",
            "    @staticmethod",
            "    def backward(ctx, grad):",
            "        x, w = ctx.saved_tensors",
            "        return grad @ w, (grad.transpose(-1, -2) @ x).reshape(-1, *w.shape).sum(0)",
            "",
            "class Generated(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
        ]
        lines += [f"        self.{op.module} = {op.module_source}" for op in self.ops if op.module]
        lines += [f"        self.{a}.{attribute} = self.{b}.{other}"
                  for a, attribute, b, other in self.ties]
        lines += [f"        self.{op.uses[0]}.{op.hook}" for op in self.ops if op.hook]
        head_width = sum(_numel(self.shapes[r]) for r in self.head_registers())
        lines.append(f"        self.head = nn.Linear({head_width}, {self.num_classes})")
        lines += ["", "    def forward(self, x, ids, mask):", "        r0 = x"]
        lines += [f"        {op.line}" for op in self.ops]
        flat = ", ".join(f"r{r}.flatten(1)" for r in self.head_registers())
        lines.append(f"        return self.head(torch.cat([{flat}], 1))")
        return "\n".join(lines) + "\n"

    def script(self) -> str:
        """The model's source plus the lines that build it and its inputs: a reproduction."""
        batch, (tokens, width) = self.batch_size, self.shapes[0]
        lines = [
            "",
            "torch.set_default_dtype(torch.float64)",
            f"torch.manual_seed({self.seed})",
            "model = Generated()",
            *[f"model.{name}.requires_grad_(False)" for name in sorted(self.frozen)],
            f"x = torch.randn({batch}, {tokens}, {width})",
            f"ids = torch.randint(0, {self.vocab}, ({batch}, {MAX_TOKENS}))",
            f"lengths = torch.randint(1, {MAX_TOKENS + 1}, ({batch}, 1))",
            f"mask = (torch.arange({MAX_TOKENS}) < lengths).double()  # trailing padding",
            f"labels = torch.randint(0, {self.num_classes}, ({batch},))",
            "# per-example loss: F.cross_entropy(model(x, ids, mask), labels, reduction='none')",
        ]
        return self.source() + "\n".join(lines) + "\n"

    def without(self, index: int) -> Program:
        """The program with op `index` removed, and every op that depended on it."""
        removed_registers, removed_modules, ops = set(), set(), []
        for k, op in enumerate(self.ops):
            depends = set(op.reads) & removed_registers or set(op.uses) & removed_modules
            if k == index or depends or (op.modifies in removed_registers):
                removed_registers |= {op.writes} - {None}
                removed_modules |= {op.module} - {None}
                continue
            ops.append(op)
        modules = {op.module for op in ops if op.module}
        return replace(
            self, ops=ops,
            frozen=frozenset(f for f in self.frozen if f.split(".")[0] in modules),
            ties=tuple(t for t in self.ties if t[0] in modules and t[2] in modules),
        )


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


@dataclass
class _Builder:
    rng: random.Random
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    fresh: set[int] = field(default_factory=set)  # registers nothing has read or changed
    read_by_layer: set[int] = field(default_factory=set)
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (in, out)
    embeddings: dict[str, tuple[int, int]] = field(default_factory=dict)

    def register(self, shape: tuple[int, ...], fresh: bool = False) -> int:
        """A new register; `fresh` if the model may change it in place (its producer saved
        nothing autograd needs and it is no view of another register)."""
        index = len(self.shapes)
        self.shapes[index] = shape
        if fresh:
            self.fresh.add(index)
        return index

    def module_name(self) -> str:
        return f"m{sum(op.module is not None for op in self.ops)}"

    def read(self, *registers: int) -> None:
        self.fresh -= set(registers)

    def emit(self, op: Op) -> None:
        self.ops.append(op)


def generate(seed: int, max_ops: int = 9) -> Program:
    rng = random.Random(seed)
    builder = _Builder(rng)
    tokens, width = rng.randint(2, 6), rng.randint(2, 6)
    builder.register((tokens, width))  # r0 = x, [B, T, D]
    vocab = rng.randint(4, 9)
    for _ in range(rng.randint(2, max_ops)):
        choices = [kind for kind, ok in _applicable(builder) if ok]
        kind = rng.choice(choices)
        OPS[kind](builder, vocab)
    written = [op.writes for op in builder.ops if op.writes is not None]
    dropped = frozenset(r for r in written if rng.random() < 0.15)
    program = Program(
        seed=seed, batch_size=rng.randint(2, 5), vocab=vocab, num_classes=rng.randint(2, 4),
        shapes=builder.shapes, ops=builder.ops, dropped_from_head=dropped,
        ties=tuple(_ties(builder)),
    )
    plain = [op for op in builder.ops if op.module and op.refusal != "reparametrized"]
    params = [f"{op.module}.weight" for op in plain] + [
        f"{op.module}.bias" for op in plain if _has_bias(op.module_source)
    ]
    frozen = frozenset(p for p in params if rng.random() < 0.15)
    return replace(program, frozen=frozen)


def _has_bias(module_source: str) -> bool:
    return "bias=False" not in module_source and not module_source.startswith(
        ("nn.RMSNorm", "nn.Embedding")
    )


def _ties(builder: _Builder):
    """A tied Linear's weight is another Linear's; a sharing layer shares what it says."""
    ties = [(op.module, "weight", op.uses[0], "weight") for op in builder.ops if op.tied]
    return ties + [(op.module, own, op.uses[0], other)
                   for op in builder.ops for own, other in op.shares]


def _pick(builder: _Builder, dims: int, prefer_shared: bool = False) -> int:
    candidates = [r for r, s in builder.shapes.items() if len(s) == dims]
    shared = [r for r in candidates if r in builder.read_by_layer]
    if prefer_shared and shared and builder.rng.random() < 0.6:
        return builder.rng.choice(shared)
    return builder.rng.choice(candidates)


def _applicable(builder: _Builder):
    has3 = any(len(s) == 2 for s in builder.shapes.values())
    has4 = any(len(s) == 3 for s in builder.shapes.values())
    same_shape = len({s for s in builder.shapes.values()}) < len(builder.shapes)
    return [
        ("linear", has3), ("linear_again", has3 and bool(builder.linears)),
        ("conv1d_tokens", has3), ("conv1d_raw", has3), ("norm", has3), ("embed", True),
        ("activation", True), ("mask", has3), ("add", same_shape), ("to_image", has3),
        ("conv2d", has4), ("group_norm2d", has4), ("flatten", has4),
        ("tied", bool(builder.linears)), ("functional", bool(builder.linears or builder.embeddings)),
        ("shared", bool(_shareable(builder))), ("shared_bias_as_norm", bool(_biased_linears(builder))),
        ("hook", bool(_hookable(builder))),
        ("weight_norm", has3 and builder.rng.random() < 0.1),  # refuses the whole model
    ]


# ---------------------------------------------------------------------------- operations


def _maybe_in_place(builder: _Builder, register: int) -> None:
    """Change a just-made register in place (its producer saved nothing autograd needs)."""
    rng = builder.rng
    if register in builder.fresh and rng.random() < 0.35:
        statement = rng.choice(["r{r}.relu_()", "r{r}.mul_(0.5)", "r{r}.add_(1.0)"])
        builder.emit(Op(statement.format(r=register), modifies=register))
        builder.fresh.discard(register)


def _layer(builder: _Builder, source_register: int, module_source: str, call: str,
           shape: tuple[int, ...]) -> int:
    name = builder.module_name()
    out = builder.register(shape, fresh=True)
    builder.emit(Op(
        call.format(out=out, m=name, r=source_register), reads=(source_register,), writes=out,
        module=name, module_source=module_source,
    ))
    builder.read(source_register)
    builder.read_by_layer.add(source_register)
    _maybe_in_place(builder, out)
    return out


def op_linear(builder: _Builder, vocab: int) -> None:
    source = _pick(builder, 2, prefer_shared=True)
    tokens, width = builder.shapes[source]
    out_width = builder.rng.randint(2, 6)
    bias = builder.rng.random() < 0.7
    name = builder.module_name()
    _layer(builder, source, f"nn.Linear({width}, {out_width}, bias={bias})",
           "r{out} = self.{m}(r{r})", (tokens, out_width))
    builder.linears[name] = (width, out_width)


def op_linear_again(builder: _Builder, vocab: int) -> None:
    """A layer called a second time, on whatever register fits it (or by keyword)."""
    name = builder.rng.choice(sorted(builder.linears))
    width, out_width = builder.linears[name]
    fits = [r for r, s in builder.shapes.items() if len(s) == 2 and s[1] == width]
    source = builder.rng.choice(fits)
    out = builder.register((builder.shapes[source][0], out_width))
    call = "input=r{r}" if builder.rng.random() < 0.3 else "r{r}"
    builder.emit(Op(
        ("r{out} = self.{m}(" + call + ")").format(out=out, m=name, r=source),
        reads=(source,), writes=out, uses=(name,),
    ))
    builder.read(source)
    builder.read_by_layer.add(source)


def _conv_geometry(rng: random.Random, length: int) -> tuple[int, int, int, int] | None:
    for _ in range(10):
        kernel, stride = rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2])
        dilation, padding = rng.choice([1, 1, 2]), rng.choice([0, 1, 2])
        out = (length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
        if out >= 1:
            return kernel, stride, padding, dilation
    return None


def op_conv1d(builder: _Builder, vocab: int, raw: bool) -> None:
    """Conv1d over the token axis (channels = features) or straight over [B, a, b]."""
    source = _pick(builder, 2, prefer_shared=True)
    tokens, width = builder.shapes[source]
    channels, length = (tokens, width) if raw else (width, tokens)
    geometry = _conv_geometry(builder.rng, length)
    if geometry is None:
        return
    kernel, stride, padding, dilation = geometry
    out_channels = builder.rng.randint(2, 6)
    out_length = (length + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    module = (f"nn.Conv1d({channels}, {out_channels}, {kernel}, stride={stride}, "
              f"padding={padding}, dilation={dilation})")
    if raw:
        _layer(builder, source, module, "r{out} = self.{m}(r{r})", (out_channels, out_length))
    else:
        _layer(builder, source, module, "r{out} = self.{m}(r{r}.transpose(1, 2)).transpose(1, 2)",
               (out_length, out_channels))


def op_norm(builder: _Builder, vocab: int) -> None:
    source = _pick(builder, 2)
    tokens, width = builder.shapes[source]
    kind = builder.rng.choice(["layer", "rms", "group"])
    if kind == "group" and tokens % 2 == 0 and tokens // 2 * width > 1:
        module = f"nn.GroupNorm(2, {tokens})"
    elif kind == "rms":
        module = f"nn.RMSNorm({width})"
    else:
        module = f"nn.LayerNorm({width})"
    _layer(builder, source, module, "r{out} = self.{m}(r{r})", (tokens, width))


def op_embed(builder: _Builder, vocab: int) -> None:
    tokens, width = builder.rng.randint(2, MAX_TOKENS), builder.rng.randint(2, 6)
    padding = builder.rng.choice([None, 0])
    name = builder.module_name()
    out = builder.register((tokens, width), fresh=True)
    builder.emit(Op(
        f"r{out} = self.{name}(ids[:, :{tokens}])", writes=out, module=name,
        module_source=f"nn.Embedding({vocab}, {width}, padding_idx={padding})",
    ))
    builder.embeddings[name] = (vocab, width)
    _maybe_in_place(builder, out)


def op_activation(builder: _Builder, vocab: int) -> None:
    source = builder.rng.choice(sorted(builder.shapes))
    out = builder.register(builder.shapes[source])
    function = builder.rng.choice(["torch.tanh", "F.gelu", "torch.relu"])
    builder.emit(Op(f"r{out} = {function}(r{source})", reads=(source,), writes=out))
    builder.read(source)


def op_mask(builder: _Builder, vocab: int) -> None:
    """Padding: the trailing tokens of each example get exactly zero gradient."""
    source = _pick(builder, 2)
    tokens, width = builder.shapes[source]
    if tokens > MAX_TOKENS:
        return
    out = builder.register((tokens, width), fresh=True)
    builder.emit(Op(f"r{out} = r{source} * mask[:, :{tokens}, None]", reads=(source,),
                    writes=out))
    builder.read(source)
    _maybe_in_place(builder, out)


def op_add(builder: _Builder, vocab: int) -> None:
    """A skip connection; in place into a register nothing has read yet, when there is one."""
    by_shape: dict = {}
    for r, s in builder.shapes.items():
        by_shape.setdefault(s, []).append(r)
    pairs = [rs for rs in by_shape.values() if len(rs) > 1]
    first, second = builder.rng.sample(builder.rng.choice(pairs), 2)
    if first in builder.fresh and builder.rng.random() < 0.5:
        builder.emit(Op(f"r{first} += r{second}", reads=(second,), modifies=first))
        builder.read(first, second)
        return
    out = builder.register(builder.shapes[first], fresh=True)
    builder.emit(Op(f"r{out} = r{first} + r{second}", reads=(first, second), writes=out))
    builder.read(first, second)
    _maybe_in_place(builder, out)


def op_to_image(builder: _Builder, vocab: int) -> None:
    source = _pick(builder, 2)
    out = builder.register((1, *builder.shapes[source]))
    builder.emit(Op(f"r{out} = r{source}.unsqueeze(1)", reads=(source,), writes=out))
    builder.read(source)


def op_conv2d(builder: _Builder, vocab: int) -> None:
    source = _pick(builder, 3, prefer_shared=True)
    channels, height, width = builder.shapes[source]
    rng = builder.rng
    out_channels = rng.randint(1, 3) * (2 if channels % 2 == 0 else 1)
    groups = 2 if channels % 2 == 0 and out_channels % 2 == 0 and rng.random() < 0.3 else 1
    if rng.random() < 0.2:
        kernel, dilation = rng.choice([1, 3]), rng.choice([1, 2])
        module = (f"nn.Conv2d({channels}, {out_channels}, {kernel}, padding='same', "
                  f"dilation={dilation}, groups={groups})")
        shape = (out_channels, height, width)
    else:
        geometry = _conv_geometry(rng, min(height, width))
        if geometry is None:
            return
        kernel, stride, padding, dilation = geometry

        def size(n):
            return (n + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1

        module = (f"nn.Conv2d({channels}, {out_channels}, {kernel}, stride={stride}, "
                  f"padding={padding}, dilation={dilation}, groups={groups})")
        shape = (out_channels, size(height), size(width))
    _layer(builder, source, module, "r{out} = self.{m}(r{r})", shape)


def op_group_norm2d(builder: _Builder, vocab: int) -> None:
    source = _pick(builder, 3)
    channels = builder.shapes[source][0]
    if _numel(builder.shapes[source]) < 2:  # a group needs more than one value
        return
    _layer(builder, source, f"nn.GroupNorm(1, {channels})", "r{out} = self.{m}(r{r})",
           builder.shapes[source])


def op_flatten(builder: _Builder, vocab: int) -> None:
    source = _pick(builder, 3)
    channels, height, width = builder.shapes[source]
    out = builder.register((channels, height * width))
    builder.emit(Op(f"r{out} = r{source}.flatten(2)", reads=(source,), writes=out))
    builder.read(source)


def op_tied(builder: _Builder, vocab: int) -> None:
    """A new Linear that shares an existing Linear's weight (tied weights)."""
    other = builder.rng.choice(sorted(builder.linears))
    width, out_width = builder.linears[other]
    fits = [r for r, s in builder.shapes.items() if len(s) == 2 and s[1] == width]
    source = builder.rng.choice(fits)
    name = builder.module_name()
    out = builder.register((builder.shapes[source][0], out_width))
    builder.emit(Op(
        f"r{out} = self.{name}(r{source})", reads=(source,), writes=out, module=name,
        module_source=f"nn.Linear({width}, {out_width}, bias=False)", uses=(other,), tied=True,
    ))
    builder.read(source)


def op_functional(builder: _Builder, vocab: int) -> None:
    """Another layer's weight used outside that layer: a tied LM head F.linear(h, E), the same
    through a custom autograd.Function, or behind control flow that depends on the micro-batch
    (the use happens in some micro-batches only)."""
    weights = {**{n: (o, i) for n, (i, o) in builder.linears.items()}, **builder.embeddings}
    name = builder.rng.choice(sorted(weights))
    rows, columns = weights[name]
    fits = [r for r, s in builder.shapes.items() if len(s) == 2 and s[1] == columns]
    if not fits:
        return
    source = builder.rng.choice(fits)
    out = builder.register((builder.shapes[source][0], rows))
    use = builder.rng.choice([
        "F.linear(r{s}, self.{m}.weight)",
        "Matmul.apply(r{s}, self.{m}.weight)",
        # The same numbers either way (each example's loss is its own), but the weight gets
        # a gradient only from micro-batches where the condition holds.
        ("F.linear(r{s}, self.{m}.weight if bool((ids[:, 0] % 3 == 0).any()) "
         "else self.{m}.weight.detach())"),
    ]).format(s=source, m=name)
    builder.emit(Op(f"r{out} = {use}", reads=(source,), writes=out, uses=(name,),
                    refusal="functional"))
    builder.read(source)


def _shareable(builder: _Builder) -> list[Op]:
    return [op for op in builder.ops if op.module and op.writes is not None and not op.tied
            and not op.refusal and not op.shares]


def op_shared(builder: _Builder, vocab: int) -> None:
    """A second layer built like an existing one, on the same input, sharing its weight, its
    bias or both (a Linear, a convolution, a norm, an embedding)."""
    original = builder.rng.choice(_shareable(builder))
    options = [("weight",)] + ([("bias",), ("weight", "bias")]
                               if _has_bias(original.module_source) else [])
    shared = builder.rng.choice(options)
    name = builder.module_name()
    out = builder.register(builder.shapes[original.writes], fresh=True)
    line = original.line.replace(f"r{original.writes} = ", f"r{out} = ", 1)
    builder.emit(Op(
        line.replace(f"self.{original.module}(", f"self.{name}(", 1), reads=original.reads,
        writes=out, module=name, module_source=original.module_source,
        uses=(original.module,), shares=tuple((a, a) for a in shared),
    ))
    builder.read(*original.reads)
    _maybe_in_place(builder, out)


def _biased_linears(builder: _Builder) -> list[Op]:
    return [op for op in _shareable(builder)
            if op.module in builder.linears and "bias=True" in op.module_source]


def op_shared_bias_as_norm(builder: _Builder, vocab: int) -> None:
    """A LayerNorm on a Linear's output whose scale or shift IS the Linear's bias: one
    parameter under two rules."""
    linear = builder.rng.choice(_biased_linears(builder))
    tokens, width = builder.shapes[linear.writes]
    attribute = builder.rng.choice(["weight", "bias"])
    name = builder.module_name()
    out = builder.register((tokens, width), fresh=True)
    builder.emit(Op(
        f"r{out} = self.{name}(r{linear.writes})", reads=(linear.writes,), writes=out,
        module=name, module_source=f"nn.LayerNorm({width})", uses=(linear.module,),
        shares=((attribute, "bias"),),
    ))
    builder.read(linear.writes)


def _hookable(builder: _Builder) -> list[Op]:
    hooked = {op.uses[0] for op in builder.ops if op.hook}
    return [op for op in builder.ops if op.module and op.refusal is None
            and op.module not in hooked]


def op_hook(builder: _Builder, vocab: int) -> None:
    """A hook that changes what a layer sees or returns (activation steering)."""
    target = builder.rng.choice(_hookable(builder))
    hooks = ["register_forward_hook(lambda module, args, out: out * 3.0)",
             "register_forward_hook(lambda module, args, out: (out.mul_(-2.0), None)[1])"]
    if "Embedding" not in target.module_source:
        hooks.append("register_forward_pre_hook("
                     "lambda module, args: tuple(a * 2.0 for a in args) or None)")
    builder.emit(Op("pass  # a hook changes this layer", uses=(target.module,),
                    hook=builder.rng.choice(hooks)))


def op_weight_norm(builder: _Builder, vocab: int) -> None:
    """A Linear under weight_norm (hook style, or torch.nn.utils.parametrizations')."""
    source = _pick(builder, 2)
    tokens, width = builder.shapes[source]
    out_width = builder.rng.randint(2, 6)
    wrapper = builder.rng.choice(["torch.nn.utils.weight_norm",
                                  "torch.nn.utils.parametrizations.weight_norm"])
    name = builder.module_name()
    out = builder.register((tokens, out_width))
    builder.emit(Op(
        f"r{out} = self.{name}(r{source})", reads=(source,), writes=out, module=name,
        module_source=f"{wrapper}(nn.Linear({width}, {out_width}))", refusal="reparametrized",
    ))
    builder.read(source)


OPS = {
    "linear": op_linear, "linear_again": op_linear_again,
    "conv1d_tokens": lambda b, v: op_conv1d(b, v, raw=False),
    "conv1d_raw": lambda b, v: op_conv1d(b, v, raw=True),
    "norm": op_norm, "embed": op_embed, "activation": op_activation, "mask": op_mask,
    "add": op_add, "to_image": op_to_image, "conv2d": op_conv2d,
    "group_norm2d": op_group_norm2d, "flatten": op_flatten, "tied": op_tied,
    "functional": op_functional, "shared": op_shared,
    "shared_bias_as_norm": op_shared_bias_as_norm, "hook": op_hook,
    "weight_norm": op_weight_norm,
}
