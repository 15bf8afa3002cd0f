"""The ipc backend's host-side contracts, checked without a GPU: the kernels' argument block
has the same fields in the same order on both sides, the buffer layout gives every collective
and message ring room (routing: tests/test_ipc_routes.py)."""

from __future__ import annotations

import ctypes
import re

import pytest

from anyccl.backends.ipc import compiler
from anyccl.backends.ipc.memory import MAX_RANKS, TILE_BYTES, KernelArgs, Layout

_C_TYPES = {"u64": ctypes.c_uint64, "float": ctypes.c_float, "int": ctypes.c_int}


def c_fields() -> list[tuple[str, str, bool, bool]]:
    """(name, C type, is a pointer, is an array) of kernels.cu's struct Args fields, in order."""
    source = (compiler.KERNELS / "primitives.cuh").read_text()
    body = re.search(r"struct Args \{(.*?)\};", source, re.S).group(1)
    fields = []
    for line in body.splitlines():
        declaration = line.split("//")[0].strip().rstrip(";")
        if not declaration:
            continue
        m = re.match(r"(?:const\s+)?(?:volatile\s+)?(\w+)\s*(\*?)\s*(.+)$", declaration)
        ctype, pointer, names = m.group(1), bool(m.group(2)), m.group(3)
        for name in names.split(","):
            name = name.strip()
            fields.append((name.split("[")[0], ctype, pointer, "[" in name))
    return fields


def test_the_python_argument_block_matches_the_kernels_struct_field_for_field():
    c = c_fields()
    python = KernelArgs._fields_
    assert [n for n, _ in python] == ["inp" if n == "in" else n for n, *_ in c]
    for (name, ctype), (_, c_type, pointer, array) in zip(python, c):
        if array:                                     # MAX_RANKS pointers
            assert ctype._length_ == MAX_RANKS and ctypes.sizeof(ctype) == 8 * MAX_RANKS, name
        elif pointer:
            assert ctype is ctypes.c_uint64, name
        else:
            assert ctype is _C_TYPES[c_type], name


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 8])
def test_the_layout_gives_each_rank_a_slot_per_peer_and_flags_for_every_tile(nranks):
    lay = Layout(nranks)
    assert lay.half_bytes == 2 * nranks * lay.slot_bytes          # send and gather slots
    assert lay.slot_bytes % TILE_BYTES == 0 and lay.max_tiles == lay.slot_bytes // TILE_BYTES
    assert TILE_BYTES <= lay.tile_bytes <= lay.slot_bytes and lay.tile_bytes % TILE_BYTES == 0
    assert lay.p2p_offset == 2 * lay.half_bytes
    assert lay.ce_offset == lay.p2p_offset + nranks * lay.slots * lay.chunk_bytes
    # the copy-engine ring area (none alone), holding two chunks at least
    assert lay.data_bytes == lay.ce_offset + lay.ce_ring_bytes
    assert lay.ce_ring_bytes % TILE_BYTES == 0
    assert lay.ce_ring_bytes >= 2 * TILE_BYTES if nranks > 1 else lay.ce_ring_bytes == 0
    assert lay.slots >= 2 and lay.sig_bytes % 8 == 0
    assert lay.ce_sig_offset + 8 * lay.ce_flag_words == lay.sig_bytes   # its flags: last


def test_the_copy_engine_area_follows_the_environment_and_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("ANYCCL_IPC_CE_MB", "3")
    assert Layout(2).ce_ring_bytes == Layout(4).ce_ring_bytes == 3 << 20   # one sender: the
    assert Layout(1).ce_ring_bytes == 0                                   # previous rank
    monkeypatch.setenv("ANYCCL_IPC_CE_MB", "0")
    lay = Layout(2)
    assert lay.ce_ring_bytes == 0 and lay.data_bytes == lay.ce_offset


def test_buffer_sizes_follow_the_environment(monkeypatch):
    monkeypatch.setenv("ANYCCL_IPC_HALF_MB", "2")
    monkeypatch.setenv("ANYCCL_IPC_RING_MB", "4")
    monkeypatch.setenv("ANYCCL_TUNING", "ipc.tile=128K")
    lay = Layout(2)
    assert (lay.slot_bytes, lay.slots, lay.tile_bytes) == (512 << 10, 4, 128 << 10)


def test_compiled_kernels_are_cached_under_anyccl_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ANYCCL_CACHE_DIR", str(tmp_path))
    assert compiler.cache_dir() == tmp_path / "kernels"
    compiled: list[str] = []

    def nvrtc(source: str, arch: str) -> bytes:  # stands in for NVRTC: counts the compiles
        compiled.append(arch)
        return f"cubin {arch} {len(source)}".encode()

    monkeypatch.setattr(compiler, "_compile", nvrtc)
    monkeypatch.setattr(compiler.gpu, "compute_capability", lambda device: (9, 0))
    first = compiler.cubin(0)
    assert compiled == ["sm_90"]
    assert [p.name.startswith("ipc-sm_90-") for p in (tmp_path / "kernels").iterdir()] == [True]
    assert compiler.cubin(0) == first and compiled == ["sm_90"]  # from the cache, no compile
    monkeypatch.setattr(compiler.gpu, "compute_capability", lambda device: (8, 0))
    compiler.cubin(0)
    assert compiled == ["sm_90", "sm_80"]  # another architecture: its own cubin
    changed = tmp_path / "movement.cu"
    changed.write_text((compiler.KERNELS / "movement.cu").read_text() + "\n// changed\n")
    monkeypatch.setattr(compiler, "SOURCES", [changed if p.name == "movement.cu" else p
                                              for p in compiler.SOURCES])
    compiler.cubin(0)
    assert compiled == ["sm_90", "sm_80", "sm_80"]  # a changed source is compiled again
    assert len(list((tmp_path / "kernels").iterdir())) == 3


def test_the_shared_constants_are_defined_once_in_python_for_the_kernels():
    from anyccl.backends.ipc import memory

    text = compiler.source()
    for name, value in memory.KERNEL_DEFINES.items():
        assert text.count(f"#define {name} ") == 1, name  # only the one Python writes
        assert f"#define {name} {value}\n" in text
    for path in compiler.SOURCES:  # and no file defines one itself
        assert not re.search(r"#define (MAX_RANKS|THREADS|MIN_TILE_BYTES|SIG_FLAGS|STATUS_)",
                             path.read_text()), path.name


def test_every_kernel_the_backend_launches_is_an_entry_point_of_the_source(tmp_path):
    import shutil
    import subprocess

    names = compiler.kernel_names()
    assert len(names) == len(set(names)) == 8 + 6 * 3 * 3
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here to compile the kernels without a GPU")
    source = tmp_path / "kernels.cu"
    source.write_text(compiler.source())
    ptx = tmp_path / "kernels.ptx"  # the front end is what can fail here; PTX is quicker
    proc = subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-std=c++17", str(source), "-o",
                           str(ptx)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = set(re.findall(r"\.entry\s+([A-Za-z_0-9]+)", ptx.read_text()))
    missing = [n for n in names if n not in entries]
    assert not missing, missing
