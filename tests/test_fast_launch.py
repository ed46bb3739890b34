"""The cached launch path (gdngen.runtime.launch.fast) on CPU: its key, its fallbacks, and the
positional layout of the CompiledKernel.run call it makes on a hit (with a fake compiled kernel)."""
import os
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from gdngen.runtime import launch


def _probe(x, y, n, scale, flag, maybe, H: tl.constexpr, BT: tl.constexpr = 16):
    pass


class _FakeCompiled:
    """Stands in for a loaded CUDA CompiledKernel: records every run(...) call."""

    def __init__(self):
        self.metadata = SimpleNamespace(target=SimpleNamespace(backend="cuda"))
        self.function = 0xF00D
        self.packed_metadata = (4, 1, 0)
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


STREAM = 0x5EED


@pytest.fixture
def probe():
    """A FastLaunch over a real (uncompiled) JITFunction whose plain path returns a fake compiled
    kernel and counts its calls; the device and stream come from stubs instead of a GPU."""
    launcher = launch.FastLaunch(JITFunction(_probe))
    compiled = _FakeCompiled()
    plain = []

    def launch_plain(grid, args, kwargs):
        plain.append((grid, args, kwargs))
        return compiled

    launcher._launch_plain = launch_plain
    launcher._get_device = lambda: 0
    launcher._get_stream = lambda device: STREAM
    launch.set_fast(True)
    yield launcher, compiled, plain
    launch.set_fast(os.environ.get("GDNGEN_FAST_LAUNCH", "1") != "0")


def _tensors(dtype=torch.float32):
    base = torch.zeros(64, dtype=dtype)
    return base, base[1:]           # 16-byte aligned, and not (one element further)


def _key(launcher, *args, **kwargs):
    return _key_on(launcher, 0, args, kwargs)


def _key_on(launcher, device, args, kwargs):
    form = (len(args), *kwargs)
    shape = launcher._shape(form)
    return launcher._key(shape, launcher._bind(shape, args, kwargs), kwargs, device)


def test_key_covers_what_triton_specialises_on(probe):
    launcher, _, _ = probe
    a, misaligned = _tensors()
    base = dict(n=32, scale=0.5, flag=True, maybe=None, H=4)

    def key(x=a, **changes):
        kw = dict(base, **changes)
        return _key(launcher, x, a, kw.pop("n"), kw.pop("scale"), kw.pop("flag"), kw.pop("maybe"), **kw)

    reference = key()
    assert key() == reference
    assert key(x=misaligned) != reference                        # pointer alignment
    assert (_key(launcher, misaligned, a, 32, 0.5, True, None, H=4)  # which pointer is misaligned
            != _key(launcher, a, misaligned, 32, 0.5, True, None, H=4))
    assert key(x=a.to(torch.bfloat16)) != reference              # dtype
    assert key(n=1) != reference                                 # int == 1 (a constexpr in Triton)
    assert key(n=33) != reference                                # int % 16
    assert key(n=48) == reference                                # same specialisation
    assert key(n=1 << 32) != reference                           # i64, not i32
    assert key(scale=2.0) == reference                           # floats: fp32 whatever the value
    assert key(flag=False) == reference                          # bools: u1 whatever the value
    assert key(maybe=a) != reference                             # None vs a tensor
    assert key(H=8) != reference                                 # constexpr value
    assert key(H=True) != key(H=1)                               # constexpr type (1 == True)
    assert key(BT=32) != reference                               # a defaulted constexpr given
    assert key(num_warps=8) != key(num_warps=4) != reference     # launch options
    assert _key(launcher, a, a, 32, 0.5, True, None, H=4) != _key(launcher, a, a, 32, 0.5, True, None, 4)
    args = (a, a, 32, 0.5, True, None)
    assert _key_on(launcher, 0, args, {"H": 4}) != _key_on(launcher, 1, args, {"H": 4})      # device


def test_int_and_tensor_keys_determine_tritons_specialisation():
    """Within a group of equal keys, Triton's own specialisation (the native specialize_impl) is
    one value: the key is at least as fine as what Triton compiles for."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def triton_spec(value):
        return native_specialize_impl(BaseBackend, value, False, True, True)

    groups = {}
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, -(1 << 31),
            -(1 << 31) - 16, (1 << 63) - 16, 1 << 63, (1 << 64) - 16, 7 << 40, -(1 << 63)]
    for value in ints:
        groups.setdefault(launch._int_key(value), set()).add(triton_spec(value))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        for tensor in _tensors(dtype):
            groups.setdefault((dtype, tensor.data_ptr() % 16 == 0), set()).add(triton_spec(tensor))
    assert all(len(specs) == 1 for specs in groups.values()), groups


def test_hit_calls_run_with_every_bound_argument(probe):
    launcher, compiled, plain = probe
    a, b = _tensors()
    args = (a, a, 32, 0.5, True, None)
    assert launcher[(3, 2)](*args, H=4) is compiled          # miss: the plain path launches
    assert len(plain) == 1 and not compiled.calls
    assert launcher[(3, 2)](*args, H=4, ) is compiled         # hit: straight to run
    assert len(plain) == 1
    # grid padded to 3, stream, function, packed metadata, no launch metadata and no hooks, then
    # every parameter in declaration order: constexprs (and defaulted ones) included, as
    # JITFunction.run passes ``*bound_args.values()`` and the launchers drop them themselves
    assert compiled.calls == [(3, 2, 1, STREAM, 0xF00D, (4, 1, 0), None, None, None,
                               a, a, 32, 0.5, True, None, 4, 16)]
    launcher[(5,)](*args[:2], 48, 2.0, False, None, BT=32, H=4)    # new key (BT): miss
    launcher[(5,)](*args[:2], 64, 2.0, False, None, BT=32, H=4)    # same key: hit
    assert len(plain) == 2
    assert compiled.calls[-1] == (5, 1, 1, STREAM, 0xF00D, (4, 1, 0), None, None, None,
                                  a, a, 64, 2.0, False, None, 4, 32)
    launcher[(3, 2)](b, a, 32, 0.5, True, None, H=4)                # misaligned: a miss
    assert len(plain) == 3


def test_fallbacks_take_the_plain_path(probe, monkeypatch):
    launcher, compiled, plain = probe
    a, _ = _tensors()
    args = (a, a, 32, 0.5, True, None)
    launcher[(1,)](*args, H=4)

    def plain_calls(*call_args, **call_kwargs):
        before = len(plain)
        launcher[(1,)](*call_args, **call_kwargs)
        return len(plain) - before

    assert plain_calls(*args, H=4) == 0                              # cached
    launch.set_fast(False)
    assert plain_calls(*args, H=4) == 1                              # switched off
    launch.set_fast(True)
    from triton import knobs
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    assert plain_calls(*args, H=4) == 1                              # a profiler's launch hook
    monkeypatch.undo()
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: None)
    assert plain_calls(*args, H=4) == 1                              # JITFunction.run replaced
    monkeypatch.undo()
    assert plain_calls(*args, H=4) == 0
    assert plain_calls(*args, H=[4]) == 1                            # unhashable constexpr
    assert plain_calls(a, a, torch.tensor(3).numpy(), 0.5, True, None, H=4) == 1   # unkeyed type
    assert plain_calls(*args) == 1                                   # H missing: Triton raises
    before = len(plain)
    launcher[lambda meta: (1,)](*args, H=4)                          # a callable grid
    assert len(plain) == before + 1


def test_fast_returns_the_kernel_where_it_cannot_apply(monkeypatch):
    kernel = JITFunction(_probe)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.fast(kernel) is kernel                             # CPU interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    assert isinstance(launch.fast(kernel), launch.FastLaunch)
    other = object()
    assert launch.fast(other) is other                               # not a plain @triton.jit
    monkeypatch.setattr(launch, "VERIFIED_TRITON", frozenset())
    assert launch.fast(kernel) is kernel                             # unverified Triton version


def test_generated_modules_fall_back_under_the_interpreter():
    """On CPU (TRITON_INTERPRET=1) the generated modules' launchers are the kernels themselves."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tier only")
    import importlib
    module = importlib.import_module("generated.gated_delta_rule")
    assert module._state_fwd_fast is module._state_fwd_kernel
    assert module._WY_FAST[64] is module._WY_KERNELS[64]


def test_host_tensor_descriptors_are_keyed_not_refused():
    """A host-built tensor descriptor argument takes the cached path: its key holds what its specialisation
    and launch read (dtype, block shape, layout, base alignment, shape's and strides' int keys), not the base."""
    from gdngen.runtime import gluon
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    x, y = torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    a, b = gluon.row_descriptor(x, 128, [64, 64]), gluon.row_descriptor(y, 128, [64, 64])
    layout = launch._ArgLayout.of((type(a), torch.Tensor, int))
    assert layout is not None and layout.descriptors((a, x, 3)) == (a,)
    assert launch._descriptor_key(a) == launch._descriptor_key(b)          # another base, the same launch
    assert launch._descriptor_key(a) != launch._descriptor_key(gluon.row_descriptor(x, 128, [32, 64]))
    assert launch._descriptor_key(a) != launch._descriptor_key(gluon.row_descriptor(x.half(), 128, [64, 64]))
    # rows of 72: its shape's int key (72 % 16 != 0) is another specialisation
    assert launch._descriptor_key(a) != launch._descriptor_key(gluon.row_descriptor(torch.zeros(72, 128, dtype=torch.bfloat16), 128, [64, 64]))


def test_row_descriptors_of_a_known_view_shape_are_copies_of_a_checked_one():
    """row_descriptor builds and checks the first descriptor of a view shape; later ones copy its fields with the
    new base and carry its launch key. Every field and the key equal a freshly built descriptor's, the memo holds no
    tensor, and a base Triton's checks refuse is still refused."""
    import dataclasses
    import gc
    import weakref
    from gdngen.runtime import gluon, tma
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    tma._ROW_DESCRIPTORS.clear()
    first, x = torch.zeros(4, 64, 128, dtype=torch.bfloat16), torch.ones(4, 64, 128, dtype=torch.bfloat16)
    gluon.row_descriptor(first, 128, [64, 128])                      # the checked one
    copy = gluon.row_descriptor(x, 128, [64, 128])
    fresh = gluon.TensorDescriptor(x, [256, 128], [128, 1], [64, 128], copy.layout)
    assert copy.base is x and all(getattr(copy, f.name) == getattr(fresh, f.name) for f in dataclasses.fields(fresh)
                                  if f.name != "base")
    assert launch._descriptor_key(copy) == launch.descriptor_key(fresh) == launch.descriptor_key(copy)
    other = gluon.row_descriptor(x.half(), 128, [64, 128])             # another dtype: its own checked descriptor
    assert launch._descriptor_key(other) == launch.descriptor_key(other) != launch._descriptor_key(copy)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None                                             # the memo kept no tensor
    flat = torch.zeros(256 * 128 + 1, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        gluon.row_descriptor(flat[1:], 128, [64, 128])                # same view shape, misaligned base


def test_importing_the_launcher_does_not_import_gluon():
    """The descriptor classes are looked up at the first launch that needs them: importing Gluon costs ~0.55 s,
    which a generated module without Gluon kernels should not pay at its import."""
    import subprocess
    import sys
    code = "import sys, gdngen.runtime.launch; print('triton.experimental.gluon' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tile_descriptors_are_memoised_apart_from_gluon_ones():
    """tile_descriptor (a Triton kernel's host descriptor) shares row_descriptor's memo but not its entries: for
    one view shape each gives its own kind, every field equal to a freshly built one's, the key the same as a
    fresh one's and the memo's copy carrying the new base."""
    import dataclasses
    from triton.tools.tensor_descriptor import TensorDescriptor
    from gdngen.runtime import tma
    tma._ROW_DESCRIPTORS.clear()
    first, x = torch.zeros(4, 64, 128, dtype=torch.bfloat16), torch.ones(4, 64, 128, dtype=torch.bfloat16)
    tma.tile_descriptor(first, 128, [64, 128])
    copy = tma.tile_descriptor(x, 128, [64, 128])
    fresh = TensorDescriptor(x, [256, 128], [128, 1], [64, 128])
    assert type(copy) is TensorDescriptor and copy.base is x
    assert all(getattr(copy, f.name) == getattr(fresh, f.name) for f in dataclasses.fields(fresh) if f.name != "base")
    assert launch._descriptor_key(copy) == launch.descriptor_key(fresh)
    from gdngen.runtime import gluon
    if gluon.AVAILABLE:
        assert type(gluon.row_descriptor(x, 128, [64, 128])) is not TensorDescriptor
