"""Small decisions every launcher makes the same way."""
from __future__ import annotations

import functools
import itertools
import operator
import os

import torch


def runs_kernels(x: torch.Tensor) -> bool:
    """Whether Triton kernels run on ``x``: compiled on a CUDA tensor, or under TRITON_INTERPRET=1 on a CPU one."""
    # (x.is_cuda first: x.device builds a device object, 4x the time)
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def check_backend(x: torch.Tensor) -> None:
    """Triton kernels run compiled on CUDA tensors, or under TRITON_INTERPRET=1 on CPU tensors."""
    if runs_kernels(x):
        return
    raise ValueError(f"q: tensors on {x.device} need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors "
                     "(set before triton is imported)")


def contiguous(x):
    """Copy only when the last dimension is strided (the kernels take row-major rows)."""
    if x is None:
        return None
    if x.stride(-1) != 1 or not x.is_contiguous():
        return x.contiguous()
    return x


def dot_precision(dtype: torch.dtype, float32_operands: str = "tf32") -> str:
    """``input_precision`` of the kernels' dots for inputs of ``dtype``: it only acts on dots whose
    operands are float32. fp32 inputs must not silently drop to TF32 (about 3e-4 relative error)
    on the GPU: "ieee". Half-precision inputs: ``float32_operands`` for the float32 intermediates
    ("tf32"; "tf32x3", three TF32 passes at about float32 accuracy, with dtypes.intermediates: float32)."""
    if float32_operands not in ("tf32", "tf32x3", "ieee"):
        raise ValueError(f"float32_operands: expected 'tf32', 'tf32x3' or 'ieee', got {float32_operands!r}")
    return "ieee" if dtype == torch.float32 else float32_operands


def half_intermediate(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the delta rule's intermediates (T, X, V_new, the output's scores) under
    ``dtypes.intermediates: float16``: float16 for 16-bit inputs, the inputs' own dtype otherwise.

    float16 keeps 11 significant bits where bf16 keeps 8, at the same bytes and tensor-core rate:
    GDN's bf16 output error against float64 3.33e-3 -> 1.76e-3 on the H200 at (1, 4096, 16, 32),
    K=V=128 (the floor, the float64 output rounded once to bf16, is ~1.66e-3). Its range ends at 65504: V_new,
    the delta rule's residual beta (v - S^T k), is of the values' size for unit keys, and T = (I + A)^-1
    of order one unless a chunk's keys nearly repeat; a value past the range becomes inf in the output
    (loud, never a finite wrong number)."""
    return torch.float16 if dtype in (torch.bfloat16, torch.float16) else dtype


def solve_precision(input_dtype: torch.dtype, out_dtype: torch.dtype) -> str:
    """``input_precision`` of the wy stage's triangular-solve products, which act on float32 blocks.

    Where the solve's result is rounded to a 16-bit dtype (T, or W and U, stored in the 16-bit
    inputs' dtype) one TF32 pass is enough: on the H200 (gated_delta_rule, K=V=128, chunk 64) it
    left T 9.4e-5 from a float64 inverse against 1.5e-8 for "ieee", below bf16's (~2e-3) and fp16's
    (~3e-4) own rounding of T, and ran the stage 2.3x faster (481 -> 210 us at (1,32768,32,32):
    tensor cores instead of CUDA-core FMAs; "tf32x3" ran 510 us - benchmarks/NOTES.md, stop 26).
    A float32 result (float32 inputs, ``dtypes.intermediates: float32``, the backward's recomputed
    T) keeps "ieee".

    A float16 result (``dtypes.intermediates: float16``) takes "fp16": the products' operands rounded
    to float16, which keeps TF32's 10 mantissa bits at half its instructions, and an accumulator
    needs no reordering to become an operand (stages/wy.py.j2, _dot_nt). Its range ends at 65504:
    the powers of A that the diagonal blocks' product forms, and their partial products, stay below
    2^14 while |A_ij| <= 1 (unit keys, beta <= 1), but reach ~1e5 at beta = 1.9 over repeated keys
    (allow_neg_eigval), where float16 operands gave inf. So the kernel checks each chunk's diagonal
    blocks and solves a chunk with any |A_ij| > 1 in tf32 instead."""
    half = (torch.bfloat16, torch.float16)
    if input_dtype not in half or out_dtype not in half:
        return "ieee"
    return "fp16" if out_dtype == torch.float16 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids on the host: triton.cdiv is a constexpr function since Triton 3.4,
    about 2 us a call through its argument unwrapping (9 to 20 calls per op call)."""
    return -(-a // b)


_SM_COUNTS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA device ``device`` (read once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def tile_grid(config: dict, tiles: tuple, device: torch.device) -> tuple:
    """The grid and launch keywords of a chunk-parallel kernel (stages/_persistent.j2) over ``tiles``,
    its one-program-per-tile grid (dimension 0 fastest).

    ``config["PERSISTENT"]`` (a tile option; 0 or absent: one program per tile) asks for a
    persistent grid instead: that many programs per SM (on CPU: that many programs), each looping
    over tiles p, p + P, p + 2P, ... of the flattened grid, so that Triton's pipeliner issues a
    tile's loads while the tile before computes. The kernel then gets PERSISTENT (the count, a
    constexpr: a launch records what it was asked), N_TILES and the grid's leading sizes (TILES_0,
    ...) to decode its tile indices. Returns ``(grid, keywords)``.
    """
    per_sm = config.get("PERSISTENT", 0)
    if not per_sm:
        if "PERSISTENT" in config:
            config = {key: value for key, value in config.items() if key != "PERSISTENT"}
        return tiles, config
    if not isinstance(per_sm, int) or isinstance(per_sm, bool) or per_sm < 0:
        raise ValueError(f"PERSISTENT: expected a count of programs per SM (an int >= 0), got {per_sm!r}")
    total = functools.reduce(operator.mul, tiles, 1)
    sms = sm_count(device) if device.type == "cuda" else 1
    keywords = dict(config, N_TILES=total)
    for i, size in enumerate(tiles[:-1]):
        keywords[f"TILES_{i}"] = size
    return (max(1, min(total, per_sm * sms)),), keywords


# ---------------------------------------------------------------------------------------------
# Cached launch path: ``fast(kernel)[grid](*args, **kwargs)``
#
# ``kernel[grid](...)`` costs about 28 us of host time a launch (Triton 3.6, H200 host): the
# argument binder, the specialisation key, its string form, the cache look-up, the launch metadata
# and the launch hooks, all per call. Once a launch has compiled and loaded its kernel, the same
# kernel object would serve every later call whose arguments specialise the same way, so
# ``FastLaunch`` keeps a small cache of its own, keyed on a cheap tuple that holds at least
# everything Triton specialises on, and on a hit calls ``CompiledKernel.run`` (the C launcher)
# directly. What Triton 3.6 and 3.9 specialise on (triton/runtime/jit.py
# ``create_function_from_signature`` and ``JITFunction.run``; python/src/specialize.cc
# ``specialize_arg``, shipped in libtriton as ``native_specialize_impl``):
# - a tensor: its dtype (``*bf16``; ``*k`` for const params) and ``data_ptr() % 16 == 0`` ("D");
# - a Python int: == 1 (then a constexpr), % 16 == 0 ("D"), and its width: i32, i64 or u64;
# - a float: "fp32", a bool: "u1", whatever their value; None: a constexpr None;
# - a constexpr parameter: its value (the key is ``str`` of the specialisation: 1 and True differ);
# - the launch options (num_warps, num_stages, ... every keyword that names no parameter), the
#   JIT debug flag and the instrumentation mode (3.9 also the fpsan knob), and the current device
#   (one kernel cache per device). The stream is no key: it is read per launch.
# The key here holds the tensor's dtype and alignment, the int's == 1, % 16 and width class, the
# type of floats, bools and None, every constexpr's type and value, every option's type and value,
# those knobs, and the device. A host-built tensor descriptor (Gluon's or triton.tools') specialises as
# "tensordesc<dtype[block], layout>" and launches through the compiled launcher, which encodes its
# CUtensorMap from base, shape and strides per call: the key holds its dtype, block shape, layout,
# padding, base alignment and its shape's and strides' int keys. Over-keying only costs a cache entry;
# anything it cannot key (a tuple argument, an unhashable constexpr) takes the plain launch.
# ---------------------------------------------------------------------------------------------

_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _UINT64_END = -(1 << 63), 1 << 64
_TENSOR = torch.Tensor
_FIFTEENS = itertools.repeat(15)      # the low four bits of a pointer: % 16

# Triton versions whose JITFunction.run / CompiledKernel.run were read for this launcher: both call
# run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata,
#     launch_enter_hook, launch_exit_hook, *every_bound_argument)
# with every parameter in declaration order, constexprs included (the 3.6 launcher parses them
# as objects and drops them, the 3.9 launcher skips them by its argument annotations).
VERIFIED_TRITON = frozenset({(3, 6), (3, 9)})
MAX_SPECIALISATIONS = 64          # cached launches per kernel; the oldest goes first beyond this

_enabled = os.environ.get("GDNGEN_FAST_LAUNCH", "1") != "0"
_jit_run = None                   # JITFunction.run as Triton defines it (set by the first FastLaunch)


def set_fast(enabled: bool) -> None:
    """Turn the cached launch path on or off for every ``fast`` kernel (default: on unless the
    environment has GDNGEN_FAST_LAUNCH=0). Off, each launch is a plain ``kernel[grid](...)``."""
    global _enabled
    _enabled = bool(enabled)


def fast_enabled() -> bool:
    """Whether ``fast`` kernels currently take the cached launch path (see ``set_fast``)."""
    return _enabled


def triton_version() -> tuple:
    """(major, minor) of the installed Triton."""
    import triton
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def fast(kernel):
    """``kernel`` behind the cached launch path: ``fast(kernel)[grid](*args, **kwargs)`` launches
    like ``kernel[grid](*args, **kwargs)``.

    Returns ``kernel`` itself where the path cannot apply for the whole process: under
    TRITON_INTERPRET=1 (the CPU interpreter), for anything but a plain ``@triton.jit`` function
    (an autotuner picks its own options per call), and on a Triton version whose launch was not
    verified (``VERIFIED_TRITON``). A ``gluon.jit`` kernel launches through the same compiled
    launcher and takes the path too."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return kernel
    from triton.runtime.jit import JITFunction
    if type(kernel) not in (JITFunction, _gluon_jit_type()) or triton_version() not in VERIFIED_TRITON:
        return kernel
    return FastLaunch(kernel)


def _gluon_jit_type():
    """Gluon's JIT function class, or None on a Triton without Gluon."""
    try:
        from triton.experimental.gluon._runtime import GluonJITFunction
    except ImportError:
        return None
    return GluonJITFunction


def _int_key(value: int) -> int:
    """What Triton's specialisation reads off an int argument, as one small int: -1 for == 1 (a
    constexpr there); else the launcher's width (i32 0, i64 2, u64 4; beyond that Triton raises:
    6) plus 1 where value % 16 == 0."""
    if value == 1:
        return -1
    aligned = 1 if value & 15 == 0 else 0
    if _INT32_MIN <= value <= _INT32_MAX:
        return aligned
    if _INT64_MIN <= value < -_INT64_MIN:
        return 2 + aligned
    if 0 <= value < _UINT64_END:
        return 4 + aligned
    return 6


# the launches' ints (lengths, strides, sizes) repeat from call to call: a C-level memo of _int_key
_int_key_cached = functools.lru_cache(maxsize=4096)(_int_key)


def _picker(indices):
    """A function taking the items at ``indices`` of a sequence, always as a tuple (itemgetter
    returns a bare item for one index)."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        only = indices[0]
        return lambda seq: (seq[only],)
    return operator.itemgetter(*indices)


_KEYED_SCALARS = (int, float, bool, type(None))
_dtype_of = operator.attrgetter("dtype")
_data_ptr = _TENSOR.data_ptr
_MISSING = object()


class _CallShape:
    """How one call form (number of positional arguments, keyword names in order) binds to the
    kernel's parameters: computed once per form, then reused by every call of that form."""
    __slots__ = ("tail", "tail_defaults", "tail_values", "runtime", "constexprs", "options", "layouts")

    def __init__(self, tail, runtime, constexprs, options):
        self.tail = tail                # (name, default) of each parameter after the positionals;
                                        # default _MISSING: the call gives it by keyword
        # the tail's values off the call's keywords laid over its defaults: one dict merge and one
        # itemgetter (C) instead of a comprehension over the tail per launch
        self.tail_defaults = {name: default for name, default in tail if default is not _MISSING}
        self.tail_values = _picker([name for name, _ in tail])
        self.runtime = runtime          # picks the non-constexpr arguments off the bound ones
        self.constexprs = constexprs    # picks the constexpr arguments
        self.options = options          # picks the launch options (keywords naming no parameter)
        self.layouts = {}               # types of the runtime arguments -> _ArgLayout or None


@functools.cache
def _descriptor_types() -> tuple:
    """The host tensor-descriptor classes a launch may take (Gluon's Hopper one, triton.tools'), imported on
    the first launch whose arguments hold something else than tensors and scalars: importing Gluon costs
    ~0.55 s, which a module without Gluon kernels should not pay at its import."""
    types = []
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
        types.append(GluonDescriptor)
    except ImportError:
        pass
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor as ToolsDescriptor
        types.append(ToolsDescriptor)
    except ImportError:
        pass
    return tuple(types)


# the attribute a descriptor may carry its launch key in (gdngen.runtime.gluon.row_descriptor's, computed once per
# view shape): :func:`_descriptor_key` takes it instead of reading the fields again
LAUNCH_KEY_ATTRIBUTE = "gdngen_launch_key"


def descriptor_key(desc) -> tuple:
    """What a host tensor descriptor's specialisation and launch read off it, but its base's address."""
    # (a Gluon descriptor carries its shared layout; triton.tools' has none)
    return (desc.base.dtype, tuple(desc.block_shape), getattr(desc, "layout", None), desc.padding,
            desc.base.data_ptr() & 15 == 0, tuple(map(_int_key_cached, desc.shape)),
            tuple(map(_int_key_cached, desc.strides)), getattr(desc, "round_f32_to_tf32", False))


def _descriptor_key(desc) -> tuple:
    """:func:`descriptor_key`, or the one ``gdngen.runtime.gluon.row_descriptor`` computed for its view shape
    and carries (its descriptors differ only in their base, whose dtype and alignment it checked)."""
    key = desc.__dict__.get(LAUNCH_KEY_ATTRIBUTE)
    return descriptor_key(desc) if key is None else key


class _ArgLayout:
    """Where the tensors, the ints and the tensor descriptors are among the runtime arguments, for one
    tuple of their types."""
    __slots__ = ("tensors", "ints", "descriptors")

    def __init__(self, types):
        self.tensors = _picker([i for i, t in enumerate(types) if issubclass(t, _TENSOR)])
        self.ints = _picker([i for i, t in enumerate(types) if t is int])
        others = [i for i, t in enumerate(types) if t not in _KEYED_SCALARS and not issubclass(t, _TENSOR)]
        self.descriptors = _picker(others)

    @staticmethod
    def of(types):
        """The layout, or None where a type is not one the key covers (tuples, ...)."""
        others = [t for t in types if t not in _KEYED_SCALARS and not issubclass(t, _TENSOR)]
        if not others or all(t in _descriptor_types() for t in others):
            return _ArgLayout(types)
        return None


def _launches_hooked(rt, chain) -> bool:
    """Whether launch hooks, a pipeline-inspection hook or a torch.compile trace want to see each launch."""
    enter, exit_ = rt.launch_enter_hook, rt.launch_exit_hook
    if enter is not None and (type(enter) is not chain or enter.calls):
        return True
    if exit_ is not None and (type(exit_) is not chain or exit_.calls):
        return True
    if getattr(rt, "add_stages_inspection_hook", None) is not None:
        return True
    return torch.compiler.is_compiling()


def launches_observed() -> bool:
    """Whether something must see every kernel launch as it happens (so none may be replayed from a graph):
    Triton launch or inspection hooks, a replaced ``JITFunction.run`` (gdngen's compile-ahead recording,
    compilecheck, tests), a torch.compile trace. Under TRITON_INTERPRET=1 nothing is replayed either."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    from triton import knobs
    from triton.knobs import HookChain
    from triton.runtime.jit import JITFunction
    if _jit_run is not None and JITFunction.run is not _jit_run:
        return True
    return _launches_hooked(knobs.runtime, HookChain)


class FastLaunch:
    """A ``@triton.jit`` kernel with a launch cache in front: see ``fast``.

    Takes the plain ``kernel[grid](...)`` path (which compiles, caches and launches as usual)
    whenever the cached path is off (``set_fast(False)``, GDNGEN_FAST_LAUNCH=0), Triton launch
    hooks are set (profilers such as proton), a pipeline-inspection hook or a pre-run hook is set,
    ``JITFunction.run`` is replaced (gdngen's compile-ahead recording, compilecheck, tests), while
    torch.compile traces, for a grid that is not a tuple, and for arguments the key cannot hold.

    A hit skips two things JITFunction.run does per call: the pre-run hooks (checked: any set
    forces the plain path) and the check that the globals a kernel read have not changed since it
    compiled (generated modules' globals are constants)."""

    def __init__(self, kernel):
        global _jit_run
        from triton import knobs
        from triton.knobs import HookChain
        from triton.runtime.jit import JITFunction
        if _jit_run is None:
            _jit_run = JITFunction.run
        self.kernel = kernel
        self.fn = kernel.fn
        self._params = list(kernel.params)
        self._names = {p.name: i for i, p in enumerate(self._params)}
        self._plain_signature = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in kernel.signature.parameters.values())
        self._shapes = {}
        self._cache = {}
        self.misses = 0                 # launches through Triton that filled (or could not fill) the cache
        self.fallbacks = 0              # launches through Triton because the cached path did not apply
        self._get_device = None         # Triton's driver functions, taken at the first launch
        self._get_stream = None
        self._runtime_knobs = knobs.runtime
        self._compilation_knobs = knobs.compilation
        self._hook_chain = HookChain
        self._keys_fpsan = hasattr(type(knobs.compilation), "fpsan_homomorphic_casts")   # 3.9

    def __repr__(self):
        return f"fast({self.fn.__name__})"

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    # -- the plain path, and what may force it

    def _launch_plain(self, grid, args, kwargs):
        return self.kernel[grid](*args, **kwargs)

    def _fallback(self, grid, args, kwargs):
        self.fallbacks += 1
        return self._launch_plain(grid, args, kwargs)

    def _plain_needed(self) -> bool:
        """Anything that makes this call take Triton's own path, checked per call (cheap reads)."""
        kernel = self.kernel
        if type(kernel).run is not _jit_run or "run" in kernel.__dict__ or kernel.pre_run_hooks:
            return True
        return _launches_hooked(self._runtime_knobs, self._hook_chain)

    # -- binding and keys

    def _call_shape(self, form):
        """Bind a call form to the parameters, or None where only Triton's binder should (an
        argument missing, given twice, or a signature with *args / keyword-only parameters)."""
        nargs, names = form[0], form[1:]
        params = self._params
        if not self._plain_signature or nargs > len(params):
            return None
        tail = []
        for p in params[nargs:]:
            if p.name in names:
                tail.append((p.name, _MISSING))
            elif p.has_default:
                tail.append((p.name, p.default))
            else:
                return None
        if any(self._names.get(n, len(params)) < nargs for n in names):
            return None
        return _CallShape(tuple(tail),
                          _picker([i for i, p in enumerate(params) if not p.is_constexpr]),
                          _picker([i for i, p in enumerate(params) if p.is_constexpr]),
                          _picker([n for n in names if n not in self._names]))

    def _shape(self, form):
        shape = self._shapes.get(form, _MISSING)
        if shape is _MISSING:
            shape = self._shapes[form] = self._call_shape(form)
        return shape

    @staticmethod
    def _bind(shape, args, kwargs):
        """Every parameter's value in declaration order, as Triton's binder orders them."""
        if not shape.tail:
            return args
        return args + shape.tail_values({**shape.tail_defaults, **kwargs})

    def _key(self, shape, bound, kwargs, device):
        """The cache key of one call, or None where an argument has a type it does not cover."""
        runtime = shape.runtime(bound)
        types = tuple(map(type, runtime))
        layout = shape.layouts.get(types, _MISSING)
        if layout is _MISSING:
            layout = shape.layouts[types] = _ArgLayout.of(types)
        if layout is None:
            return None
        tensors = layout.tensors(runtime)
        constexprs = shape.constexprs(bound)
        options = shape.options(kwargs)
        ck = self._compilation_knobs
        # shape and layout stand for the call form and the argument types: one object each
        # pointer alignment: one True where every pointer is 16-byte aligned (the usual case: one OR
        # over the pointers), else the per-pointer flags
        pointers = tuple(map(_data_ptr, tensors))
        aligned = (True if not functools.reduce(operator.or_, pointers, 0) & 15 else
                   tuple(map(operator.not_, map(operator.and_, pointers, _FIFTEENS))))
        return (shape, layout, device,
                tuple(map(_dtype_of, tensors)),
                aligned,
                tuple(map(_int_key_cached, layout.ints(runtime))),
                tuple(map(_descriptor_key, layout.descriptors(runtime))),
                constexprs, tuple(map(type, constexprs)), options, tuple(map(type, options)),
                self._runtime_knobs.debug, ck.instrumentation_mode,
                ck.fpsan_homomorphic_casts if self._keys_fpsan else None)

    # -- launch

    def _launch(self, grid, *args, **kwargs):
        if not _enabled or type(grid) is not tuple or self._plain_needed():
            return self._fallback(grid, args, kwargs)
        form = (len(args), *kwargs)
        shape = self._shape(form)
        if shape is None:
            return self._fallback(grid, args, kwargs)
        bound = self._bind(shape, args, kwargs)
        get_device = self._get_device
        if get_device is None:
            get_device = self._take_driver()
        device = get_device()
        key = self._key(shape, bound, kwargs, device)
        try:
            entry = self._cache.get(key) if key is not None else None
        except TypeError:                # an unhashable constexpr or option
            key = entry = None
        if entry is None:
            return self._miss(grid, args, kwargs, key)
        launcher, function, packed, compiled = entry
        n = len(grid)
        launcher(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._get_stream(device),
                 function, packed, None, None, None, *bound)
        return compiled

    def _miss(self, grid, args, kwargs, key):
        """Launch through Triton, then keep what it launched under ``key`` (None: keep nothing)."""
        self.misses += 1
        compiled = self._launch_plain(grid, args, kwargs)
        if key is None:
            return compiled
        entry = self._entry(compiled)
        if entry is not None:
            cache = self._cache
            if len(cache) >= MAX_SPECIALISATIONS:
                cache.pop(next(iter(cache)), None)
            cache[key] = entry
        return compiled

    def _take_driver(self):
        """Triton's current-device and current-stream functions (the ones JITFunction.run calls)."""
        from triton.runtime import driver
        self._get_stream = driver.active.get_current_stream
        self._get_device = driver.active.get_current_device
        return self._get_device

    @staticmethod
    def _entry(compiled):
        """(launcher, function, packed metadata, compiled) of a loaded CUDA kernel, else None."""
        metadata = getattr(compiled, "metadata", None)
        target = getattr(metadata, "target", None)
        if getattr(target, "backend", None) != "cuda" or getattr(compiled, "function", None) is None:
            return None
        return compiled.run, compiled.function, compiled.packed_metadata, compiled
