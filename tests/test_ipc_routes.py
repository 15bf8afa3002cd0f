"""The ipc `auto` policy's routes, checked without a GPU: a table serves only the machine shape it
was measured on (what was never measured runs on NCCL), the cache written by `anyccl tune` comes
before the shipped tables while it measured these kernels, every rank takes rank 0's decision,
and `anyccl tune` turns its measurements into spans as documented."""

from __future__ import annotations

import json
import re
import threading

import pytest

from anyccl.backends.ipc import routes as r
from anyccl.backends.ipc.routes import NCCL, NO_END, Routes, Shape
from anyccl.errors import InvalidArgumentError
from anyccl.store import FileStore
from anyccl.tools import tune

H100X4 = Shape("NVIDIA H100 80GB HBM3", 4, "NV18")
TABLE = {"all_reduce": [[0, 1 << 20, "low_latency"], [1 << 20, 64 << 20, "two_shot"]],
         "all_gather": [[4 << 20, NO_END, "kernels"]]}


def write(path, shape, routes=TABLE, **about):
    r.store_table(path, shape, Routes.from_json(routes, "test"), about)


def test_a_route_names_the_implementation_for_a_size_and_nccl_outside_every_span():
    routes = Routes.from_json(TABLE, "test")
    assert [routes.pick("all_reduce", n) for n in (1, 1 << 20, (1 << 20) + 1, 64 << 20)] == \
        ["low_latency", "low_latency", "two_shot", "two_shot"]
    assert routes.pick("all_reduce", (64 << 20) + 1) == NCCL          # above the last span
    assert routes.pick("all_gather", 4 << 20) == NCCL and \
        routes.pick("all_gather", 1 << 40) == "kernels"
    assert routes.pick("broadcast", 8) == NCCL and routes.pick("gather", 8) == NCCL  # not named


def test_the_ipc_policy_routes_all_reduce_by_the_tuning_thresholds_and_the_rest_to_the_kernels():
    routes = Routes.kernels(16 << 10, 256 << 10, 512 << 20, "ipc", ranks=4)
    assert routes.pick("all_reduce", 16 << 10) == "low_latency"
    assert routes.pick("all_reduce", (16 << 10) + 1) == "one_shot"
    assert routes.pick("all_reduce", (256 << 10) + 4) == "two_shot"
    assert routes.pick("all_reduce", (512 << 20) - 4) == "two_shot"
    assert routes.pick("all_reduce", 512 << 20) == "copy_engines"     # from ce_min on
    assert all(routes.pick(op, n) == "kernels" for op in ("broadcast", "send", "recv")
               for n in (1, 1 << 40))
    # reduce_scatter and all_gather on the copy engines where the 4 pieces make ce_min
    for op in ("all_gather", "reduce_scatter"):
        assert routes.pick(op, 1) == routes.pick(op, (128 << 20) - 4) == "kernels"
        assert routes.pick(op, 128 << 20) == routes.pick(op, 1 << 40) == "copy_engines"
    # without a copy-engine area (ce_min beyond every size): the kernels at every size
    routes = Routes.kernels(16 << 10, 256 << 10, 1 << 62, "ipc", ranks=4)
    assert routes.pick("all_reduce", 1 << 40) == "two_shot"
    assert routes.pick("all_gather", 1 << 40) == routes.pick("reduce_scatter", 1 << 40) == \
        "kernels"
    assert Routes.from_json(Routes.kernels(1, 2, 3, "ipc", ranks=8).as_json(), "round trip")


@pytest.mark.parametrize("bad, says", [
    ({"gather": [[0, 8, "kernels"]]}, "op 'gather' has no kernels"),
    ({"all_reduce": [[0, 8, "kernels"]]}, "implementation of low_latency"),
    ({"all_reduce": [[8, 8, "one_shot"]]}, "0 <= above < at most"),
    ({"broadcast": [[0, "8", "kernels"]]}, "[above, at most, implementation]"),
    ([], "routes must be an object"),
])
def test_a_table_that_is_not_routes_is_refused_saying_what_is_wrong(bad, says):
    with pytest.raises(InvalidArgumentError, match=f"somewhere: .*{re.escape(says)}"):
        Routes.from_json(bad, "somewhere")


def test_a_shape_never_measured_runs_every_op_on_nccl_and_says_so(tmp_path):
    shipped = tmp_path / "shipped.json"
    write(shipped, Shape("NVIDIA H200", 2, "NV18"))
    for shape in (H100X4, Shape("NVIDIA H200", 4, "NV18"), Shape("NVIDIA H200", 2, "PCIe")):
        routes = r.lookup(shape, [(tmp_path / "none.json", True), (shipped, False)])
        assert routes.spans == {} and routes.pick("all_reduce", 8) == NCCL
        assert f"no table measured for {shape}" in routes.source and "anyccl tune" in \
            routes.source


def test_the_cache_comes_first_and_a_cached_table_of_another_shape_is_ignored(tmp_path):
    cache, shipped = tmp_path / "cache.json", tmp_path / "shipped.json"
    mine = {"all_reduce": [[0, NO_END, "one_shot"]]}
    write(shipped, H100X4, measured="shipped run")
    write(cache, Shape("NVIDIA H100 80GB HBM3", 2, "NV18"), mine, kernels=r.kernels_digest())
    files = [(cache, True), (shipped, False)]
    found = r.lookup(H100X4, files)             # the cache has only the 2-rank shape
    assert found.spans == Routes.from_json(TABLE, "").spans and "shipped" in found.source
    write(cache, H100X4, mine, kernels=r.kernels_digest(), measured="today")
    found = r.lookup(H100X4, files)
    assert found.pick("all_reduce", 1 << 30) == "one_shot" and "measured here" in found.source
    tables = r.read_tables(cache)                # the 2-rank table was kept beside it
    assert sorted(t["shape"]["ranks"] for t in tables) == [2, 4]


def test_a_cached_table_measured_with_other_kernels_is_not_used(tmp_path):
    cache, shipped = tmp_path / "cache.json", tmp_path / "shipped.json"
    write(cache, H100X4, {"all_reduce": [[0, NO_END, "one_shot"]]}, kernels="0123456789abcdef")
    found = r.lookup(H100X4, [(cache, True), (shipped, False)])
    assert found.spans == {} and "measured with other kernels" in found.source
    write(shipped, H100X4)
    assert r.lookup(H100X4, [(cache, True), (shipped, False)]).pick("all_gather", 1 << 30) == \
        "kernels"


def test_a_broken_cache_file_is_reported_and_the_shipped_table_still_serves(tmp_path):
    cache, shipped = tmp_path / "cache.json", tmp_path / "shipped.json"
    cache.write_text("{not json")
    write(shipped, H100X4)
    found = r.lookup(H100X4, [(cache, True), (shipped, False)])
    assert found.pick("all_reduce", 8) == "low_latency"
    with pytest.raises(InvalidArgumentError, match="not a routes table"):
        r.read_tables(cache)


def test_the_cache_file_follows_anyccl_routes_file(monkeypatch, tmp_path):
    monkeypatch.setenv("ANYCCL_ROUTES_FILE", str(tmp_path / "mine.json"))
    assert r.cache_file() == tmp_path / "mine.json"
    monkeypatch.delenv("ANYCCL_ROUTES_FILE")
    monkeypatch.setenv("ANYCCL_CACHE_DIR", str(tmp_path))
    assert r.cache_file() == tmp_path / "routes.json"


def test_the_shipped_tables_are_valid_routes_for_distinct_shapes():
    tables = r.read_tables(r.SHIPPED)
    shapes = [Shape(**t["shape"]) for t in tables]
    assert len(set(shapes)) == len(shapes) and tables
    for t in tables:
        Routes.from_json(t["routes"], "shipped")
        assert t.get("measured")


@pytest.mark.parametrize("ranks", [3, 4, 8])
def test_every_rank_takes_rank_0s_decision_whatever_it_would_find_itself(
        monkeypatch, tmp_path, ranks):
    store = FileStore(tmp_path / "store")
    models = ["NVIDIA H100 80GB HBM3"] * ranks
    monkeypatch.setattr(r, "gpu_identity", lambda d: (models[d], f"0000:{0x18 + d:02x}:00"))
    monkeypatch.setattr(r, "link_summary", lambda pcis: f"NV18 over {len(pcis)}")
    decided = []

    def decide(shape):          # only rank 0 may decide: the others' files never matter
        decided.append(shape)
        return Routes.from_json(TABLE, f"decided for {shape}")

    got = [None] * ranks

    def rank(q):
        got[q] = r.agreed(store, "job/gpu/auto", q, ranks, q, 10.0, decide)

    threads = [threading.Thread(target=rank, args=(q,)) for q in range(ranks)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    assert len(decided) == 1 and decided[0] == Shape("NVIDIA H100 80GB HBM3", ranks,
                                                     f"NV18 over {ranks}")
    assert all(g is not None for g in got)
    assert {json.dumps(g[1].as_json()) for g in got} == {json.dumps(TABLE)}
    assert {g[1].source for g in got} == {f"decided for {decided[0]}"}


def test_a_job_of_two_gpu_models_is_a_shape_of_its_own(monkeypatch):
    monkeypatch.setattr(r, "link_summary", lambda pcis: "NV18")
    mixed = r.shape_of([("NVIDIA H200", "a"), ("NVIDIA H100 80GB HBM3", "b")])
    assert mixed == Shape("NVIDIA H100 80GB HBM3 + NVIDIA H200", 2, "NV18")


# ---- anyccl tune: from measurements to spans --------------------------------------------------
def test_tune_sizes_step_by_the_factor_and_end_at_the_largest():
    assert tune.sizes(8, 1 << 10, 4) == [8, 32, 128, 512, 1024]
    assert tune.sizes(8, 8, 4) == [8]
    assert tune.per_rank("all_gather", 1 << 20, 3, 4) == (1 << 20) // 3 // 4 * 4
    assert tune.per_rank("all_reduce", 6, 4, 4) == 4 and tune.per_rank("reduce_scatter", 8, 4,
                                                                         4) == 0


def test_tune_takes_a_kernel_only_if_it_beats_nccl_by_the_margin_in_every_dtype():
    both = {"float32": 10.0, "bfloat16": 10.0}
    times = {NCCL: both, "one_shot": {"float32": 5.0, "bfloat16": 9.9},
             "two_shot": {"float32": 9.0, "bfloat16": 9.0}}
    assert tune.decide(times, 0.02) == ("two_shot", 0.9)   # one_shot's worst dtype: 0.99
    assert tune.decide(times, 0.2)[0] == NCCL              # nothing 20% faster
    assert tune.decide({NCCL: both}, 0.02) == (NCCL, 1.0)


def test_tune_spans_let_each_size_decide_up_from_the_one_below_and_leave_nccl_out():
    decisions = [(8, "low_latency"), (32, "low_latency"), (128, NCCL), (512, "two_shot"),
                 (2048, "two_shot")]
    assert tune.spans(decisions) == [(0, 32, "low_latency"), (128, NO_END, "two_shot")]
    assert tune.spans([(8, NCCL), (64, NCCL)]) == []


@pytest.mark.parametrize("argv, says", [
    (["--ops", "gather"], "--ops gather: expected some of"),
    (["--min", "1G", "--max", "8"], "need 0 < min <= max"),
    (["--margin", "1.5"], "--margin 1.5"),
    (["-n", "1"], "need at least 2 ranks"),
    (["--max", "lots"], "--max='lots' is not a size"),
])
def test_tune_refuses_bad_options_before_any_rank_starts(capsys, argv, says):
    assert tune.main(argv) == 2
    assert says in capsys.readouterr().err


def test_the_links_are_the_fewest_nvlinks_between_any_two_of_the_jobs_gpus(monkeypatch):
    from anyccl.tools import info

    pcis = ["0000:18:00", "0000:2a:00", "0000:3a:00"]
    full = {(i, j): 18 for i in range(3) for j in range(3) if i != j}
    monkeypatch.setattr(info, "_nvlink_counts", lambda devices: full)
    assert r.link_summary(pcis) == "NV18"
    monkeypatch.setattr(info, "_nvlink_counts", lambda devices: {**full, (0, 2): 0, (2, 0): 0})
    assert r.link_summary(pcis) == "PCIe"                # one pair without NVLink
    assert r.link_summary(["0000:18:00", "0000:18:00"]) == "one GPU"

    def no_nvml(devices):
        raise ImportError("pynvml")

    monkeypatch.setattr(info, "_nvlink_counts", no_nvml)   # nvidia-smi's matrix, by PCI address
    smi = {(info.pci_key(a), info.pci_key(b)): 12 for a in pcis for b in pcis if a != b}
    monkeypatch.setattr(info, "_nvidia_smi_pci_topology", lambda: smi)
    assert r.link_summary(["00000000:18:00.0", "0000:3a:00"]) == "NV12"
    monkeypatch.setattr(info, "_nvidia_smi_pci_topology", lambda: {})
    assert r.link_summary(pcis) == "unknown"


def test_tune_times_the_copy_engines_ring_only_for_large_wholes_and_where_it_has_an_area():
    from types import SimpleNamespace

    from anyccl.tools.tune import candidates

    def backend(area: int, size: int = 4):
        layout = SimpleNamespace(ce_ring_bytes=area, slot_bytes=1 << 20)
        return SimpleNamespace(layout=layout, size=size, lines_per_slot=lambda *a: 1)

    for op in ("reduce_scatter", "all_gather"):
        assert candidates(op, 8, backend(512 << 20)) == [NCCL, "kernels"]
        assert candidates(op, 16 << 20, backend(512 << 20)) == [NCCL, "kernels", "copy_engines"]
        assert candidates(op, 16 << 20, backend(0)) == [NCCL, "kernels"]       # no ring area
    assert candidates("broadcast", 1 << 30, backend(512 << 20)) == [NCCL, "kernels"]
    assert "copy_engines" in candidates("all_reduce", 64 << 20, backend(512 << 20))
    assert "copy_engines" not in candidates("all_reduce", 64 << 20, backend(512 << 20, size=1))
