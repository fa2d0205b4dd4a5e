"""kernels/ptxas.py: the whole-sequence kernels use the tensor cores on Hopper by default, only with a
ptxas >= 13.3, and a fixed ptxas is found where one is installed (fake ptxas executables stand in)."""

import os
import stat

import pytest
import torch

from kernels import ptxas, whole_sequence


def fake_ptxas(folder, release: str):
    """An executable `folder/bin/ptxas` that prints the `--version` text of CUDA `release`."""
    path = folder / "bin" / "ptxas"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def point_triton_at(monkeypatch, path: str) -> str:
    for name in ptxas.ENVS:
        monkeypatch.setenv(name, path)
    return path


def knobs_at(path: str) -> bool:
    return all(os.environ.get(name) == path for name in ptxas.ENVS)


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*ptxas.ENVS, ptxas.TENSOR_CORES_ENV, "CUDA_HOME", "CUDA_PATH", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ptxas, "_warned", False)
    return monkeypatch


def test_version_is_read_from_the_executable(tmp_path):
    assert ptxas.version_of(fake_ptxas(tmp_path / "a", "13.4")) == (13, 4)
    assert ptxas.version_of(fake_ptxas(tmp_path / "b", "12.8")) == (12, 8)
    assert ptxas.version_of(str(tmp_path / "missing")) is None


def test_hopper_needs_ptxas_13_3_other_architectures_do_not():
    assert not ptxas.tensor_core_products(90, (12, 8))
    assert not ptxas.tensor_core_products(90, (13, 2))
    assert not ptxas.tensor_core_products(90, None)
    assert ptxas.tensor_core_products(90, (13, 3))
    assert ptxas.tensor_core_products(90, (14, 0))
    assert ptxas.tensor_core_products(80, (12, 8))
    assert ptxas.tensor_core_products(100, (12, 9))


def test_products_follow_the_mode_and_the_ptxas_triton_would_use(clean_env, tmp_path):
    """WHOLE_SEQUENCE_TENSOR_CORES: by default ("auto") a Hopper GPU takes the tensor cores where
    Triton's ptxas is safe for wgmma (the old one falls back to FMA products with one warning that
    names the fix), any other GPU the FMA units; "wgmma" the same gate on any GPU; "mma" whatever
    the ptxas; "fma" never. fp32 products, CPU devices and the interpreter never depend on the mode;
    an unknown mode is refused by name."""
    arch = {"capability": (9, 0)}
    clean_env.setattr(torch.cuda, "get_device_capability", lambda device=None: arch["capability"])
    cuda = torch.device("cuda")
    old = point_triton_at(clean_env, fake_ptxas(tmp_path / "old", "12.8"))
    assert ptxas.triton_ptxas(90) == old
    assert ptxas.tensor_core_mode() == "auto"
    with pytest.warns(UserWarning, match=r"ptxas 12\.8 .*FMA units.*nvidia-cuda-nvcc>=13\.3"):
        assert whole_sequence.products(True, cuda) == whole_sequence.FMA_BF16
    clean_env.setenv(ptxas.TENSOR_CORES_ENV, "mma")
    assert whole_sequence.products(True, cuda) == whole_sequence.TENSOR_CORES
    clean_env.setenv(ptxas.TENSOR_CORES_ENV, "wgmma")
    assert whole_sequence.products(True, cuda) == whole_sequence.FMA_BF16  # warned once per process, above
    point_triton_at(clean_env, fake_ptxas(tmp_path / "new", "13.4"))
    for mode, expected in (("wgmma", whole_sequence.TENSOR_CORES), ("", whole_sequence.TENSOR_CORES),
                           ("auto", whole_sequence.TENSOR_CORES), ("fma", whole_sequence.FMA_BF16)):
        clean_env.setenv(ptxas.TENSOR_CORES_ENV, mode)
        assert whole_sequence.products(True, cuda) == expected, mode
    arch["capability"] = (8, 0)  # not Hopper: the tensor cores only on request
    for mode, expected in (("auto", whole_sequence.FMA_BF16), ("wgmma", whole_sequence.TENSOR_CORES),
                           ("mma", whole_sequence.TENSOR_CORES), ("fma", whole_sequence.FMA_BF16)):
        clean_env.setenv(ptxas.TENSOR_CORES_ENV, mode)
        assert whole_sequence.products(True, cuda) == expected, mode
    assert whole_sequence.products(False, cuda) == whole_sequence.FP32
    assert whole_sequence.products(True, torch.device("cpu")) == whole_sequence.FMA_BF16
    clean_env.setenv(ptxas.TENSOR_CORES_ENV, "tf32")
    with pytest.raises(ValueError, match="WHOLE_SEQUENCE_TENSOR_CORES='tf32': choose one of auto, wgmma, mma, fma"):
        whole_sequence.products(True, cuda)
    clean_env.setenv(ptxas.TENSOR_CORES_ENV, "wgmma")
    clean_env.setenv("TRITON_INTERPRET", "1")
    assert whole_sequence.products(True, cuda) == whole_sequence.FMA_BF16


def test_the_mma_mode_disables_wgmma_only_while_its_kernels_compile(clean_env):
    """DISABLE_MMA_V3 is set inside the launch (where Triton compiles) of a tensor-core launch in
    the "mma" mode only, and restored after, so other Triton kernels (flex attention, inductor's)
    keep wgmma."""
    clean_env.delenv("DISABLE_MMA_V3", raising=False)
    seen = []
    for mode, switch in (("mma", whole_sequence.TENSOR_CORES), ("mma", whole_sequence.FMA_BF16),
                         ("wgmma", whole_sequence.TENSOR_CORES)):
        clean_env.setenv(ptxas.TENSOR_CORES_ENV, mode)
        with whole_sequence.mma_family(switch):
            seen.append(os.environ.get("DISABLE_MMA_V3"))
        assert "DISABLE_MMA_V3" not in os.environ
    assert seen == ["1", None, None]
    clean_env.setenv("DISABLE_MMA_V3", "0")
    clean_env.setenv(ptxas.TENSOR_CORES_ENV, "mma")
    with whole_sequence.mma_family(whole_sequence.TENSOR_CORES):
        assert os.environ["DISABLE_MMA_V3"] == "1"
    assert os.environ["DISABLE_MMA_V3"] == "0"


def test_candidates_put_the_knob_then_the_toolkit_first(clean_env, tmp_path):
    knob = fake_ptxas(tmp_path / "knob", "12.8")
    toolkit = fake_ptxas(tmp_path / "toolkit", "13.5")
    point_triton_at(clean_env, knob)
    clean_env.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    assert ptxas.fixed_ptxas_candidates()[:2] == [knob, toolkit]


def test_use_fixed_ptxas_points_triton_at_an_installed_fixed_one(clean_env, tmp_path):
    old = fake_ptxas(tmp_path / "old", "12.8")
    too_new = fake_ptxas(tmp_path / "cuda14", "14.1")  # newer than the driver: its binaries would not load
    fixed = fake_ptxas(tmp_path / "cuda13", "13.5")
    point_triton_at(clean_env, old)
    clean_env.setattr(ptxas, "driver_major", lambda: 13)
    clean_env.setattr(ptxas, "fixed_ptxas_candidates", lambda: [old, fixed])
    for mode in ("mma", "fma"):  # no wgmma asked for: every kernel keeps its ptxas
        clean_env.setenv(ptxas.TENSOR_CORES_ENV, mode)
        assert ptxas.use_fixed_ptxas(90) is None and knobs_at(old)
    clean_env.setenv(ptxas.TENSOR_CORES_ENV, "wgmma")
    clean_env.setattr(ptxas, "fixed_ptxas_candidates", lambda: [old, too_new])
    assert ptxas.use_fixed_ptxas(90) is None and knobs_at(old)
    clean_env.setattr(ptxas, "fixed_ptxas_candidates", lambda: [old, too_new, fixed])
    assert ptxas.use_fixed_ptxas(80) is None and knobs_at(old)  # not Hopper: nothing to fix
    assert ptxas.use_fixed_ptxas(90) == fixed and knobs_at(fixed)
    assert ptxas.triton_ptxas(90) == fixed
    assert ptxas.use_fixed_ptxas(90) is None and knobs_at(fixed)  # already fixed: left alone
    point_triton_at(clean_env, old)
    clean_env.delenv(ptxas.TENSOR_CORES_ENV)  # the default, auto, fixes it too
    assert ptxas.use_fixed_ptxas(90) == fixed and knobs_at(fixed)


SASS = """
        /*2800*/                   WARPGROUP.ARRIVE ;                                                 /* 0x00000000000079c5 */
        /*2810*/                   HGMMA.64x8x16.F32.BF16 R48, R52, gdesc[UR44].tnspB, RZ, !UPT ;     /* 0x4000002c34307df0 */
        /*2820*/                   UMOV UR47, 0x40000040 ;                                            /* 0x40000040002f7882 */
        /*2830*/                   HGMMA.64x8x16.F32.BF16 R48, R76, gdesc[UR56].tnspB, R48, gsb0 ;    /* 0x400000384c307df0 */
        /*2840*/                   {WRITE}
        /*28d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                                    /* 0x00008000000079c5 */
        /*28e0*/                   FADD R52, RZ, -R48 ;                                               /* 0x80000030ff347221 */
"""


@pytest.mark.parametrize("write, hazards", [
    ("IMAD.MOV.U32 R87, RZ, RZ, 0x3e800000 ;", 0),  # another register: safe
    ("FADD R53, RZ, -R20 ;", 1),  # the first HGMMA's A operand (R52-R55) before the wait
    ("LDS.128 R76, [R2] ;", 1),  # the second's (R76-R79), through a 4-register load
    ("STS [R52], R3 ;", 0),  # a store reads R52, writes no register
    ("FADD R49, RZ, -R20 ;", 2),  # the accumulator both in-flight HGMMAs chain (R48-R51): one per HGMMA
    ("LDSM.16.M88.4 R50, [R2] ;", 3),  # 4 registers, R50-R53: that accumulator (x2) and the first A operand
    ("ATOM.E.ADD.STRONG.GPU PT, R53, desc[UR4][R2.64], R3 ;", 0),  # PT first: its register is the second operand
])
def test_the_sass_scan_finds_writes_to_the_registers_of_an_in_flight_hgmma(write, hazards):
    """The write after the wait (FADD R52 at 0x28e0) is never one; only writes between the
    HGMMA and its WARPGROUP.DEPBAR count, once per in-flight HGMMA whose registers they hit."""
    count, found = ptxas.wgmma_hazards(SASS.replace("{WRITE}", write))
    assert count == 2 and len(found) == hazards, found
