"""scripts/bench.py's pure helpers: CPU flags, the dtype a report names, the dtype rows planned,
the floor's parameter count and ideal work. No model, no subprocess."""

import importlib.util
import sys
from pathlib import Path

import pytest

from batchgen.job import parse_memory

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_script", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8

processor\t: 1
model name\t: other
flags\t\t: fpu
"""


def test_parse_cpuinfo_reads_the_first_processor(bench):
    info = bench.parse_cpuinfo(CPUINFO)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8481C"
    assert info["flags"]["amx_bf16"] and info["flags"]["avx512_bf16"]
    assert info["native_bf16"]


def test_parse_cpuinfo_avx2_only_has_no_native_bf16(bench):
    info = bench.parse_cpuinfo("model name : AMD EPYC\nflags : fpu avx2 avx512f\n")
    assert info["flags"] == {
        "avx2": True,
        "avx512f": True,
        "avx512_bf16": False,
        "amx_tile": False,
        "amx_bf16": False,
    }
    assert not info["native_bf16"]
    assert not bench.parse_cpuinfo("")["native_bf16"]


@pytest.mark.parametrize(
    "report, dtype",
    [
        ({"dtype": "float32"}, "float32"),
        ({"dtype": "torch.bfloat16"}, "bfloat16"),
        ({"engine": {"dtype": "bfloat16"}, "dtype": "auto"}, "bfloat16"),
        ({"numerics": "dtype=bfloat16,kv_cache_dtype=bfloat16"}, "bfloat16"),
        ({"numerics": {"dtype": "bf16"}}, "bfloat16"),
        ({"dtype": "auto"}, None),
        ({}, None),
    ],
)
def test_report_dtype(bench, report, dtype):
    assert bench.report_dtype(report) == dtype


def test_plan_dtypes(bench):
    plan = bench.plan_dtypes
    # native bf16: users' dtype bf16 first, then fp32
    assert plan(["users", "other"], "bfloat16", "users", True) == ["bfloat16", "float32"]
    # auto gave fp32 on a bf16 CPU: the other is bf16
    assert plan(["other"], "float32", "auto", True) == ["bfloat16"]
    # no native bf16: "other" adds nothing, a named dtype still runs, the default comes first
    assert plan(["users", "other"], "float32", "users", False) == ["float32"]
    assert plan(["bf16", "users"], "float32", "users", False) == ["float32", "bfloat16"]
    assert plan(["fp32", "float32", ""], "float32", "users", False) == ["float32"]
    with pytest.raises(SystemExit):
        plan(["int8"], "float32", "users", True)


def test_matmul_params_of_qwen25_05b(bench):
    cfg = {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151_936,
    }
    # 24 x (q, k, v, o, gate, up, down) + the (tied) LM head; biases are not matmul weights
    per_layer = 896 * 896 * 2 + 2 * 896 * 128 + 3 * 896 * 4864
    assert bench.matmul_params(cfg) == 24 * per_layer + 896 * 151_936 == 493_961_216


def test_workload_work_counts_shared_prefixes_once(bench):
    w = bench.Workload("R", "t", n=2, max_tokens=3, prompts=["a", "b", "c"])
    work = bench.workload_work(w, [[1, 2, 3, 4], [1, 2, 3, 5], [7, 8]])
    assert work["prompt_tokens"] == 10
    assert work["ideal_computed_prompt_tokens"] == 4 + 1 + 2
    assert work["output_tokens"] == 3 * 2 * 3
    # computed prompt tokens attend to pos + 1 keys; each sample's outputs to len + 1..len + 3
    prompt_ctx = (1 + 2 + 3 + 4) + 4 + (1 + 2)
    out_ctx = 2 * ((5 + 6 + 7) * 2 + (3 + 4 + 5))
    assert work["attention_context_sum"] == prompt_ctx + out_ctx


def test_vllm_thread_env_binds_the_first_allowed_cpus(bench):
    env = bench.vllm_thread_env(2, [3, 5, 7])
    assert env == {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "3,5"}


def test_vllm_compute_cpus_from_its_log(bench):
    log = "INFO x\n(EngineCore pid=1) INFO [omp.py:185] \tlocal_rank=0, core ids=[0, 1]\nmore"
    assert bench.vllm_compute_cpus(log) == [0, 1]
    assert bench.vllm_compute_cpus("no binding line") is None


def test_kv_capacity_and_table(bench):
    # the small model: 8 layers, 2 KV heads of 64; fp32 8192 bytes/token, int8 2 * 8 * 2 * 68
    assert parse_memory("1GiB") == 1 << 30 and parse_memory("512MiB") == 1 << 29
    assert bench.kv_capacity(1 << 30, 8192) == 131072
    assert bench.kv_capacity(1 << 30, 2176) == 493440  # whole 16-token blocks
    run = lambda kv, bpt, t: {  # noqa: E731
        "ok": True, "kv_cache_dtype": kv, "kv_bytes_per_token": bpt, "tok_s": t,
    }  # fmt: skip
    results = [
        {"name": "K", "batchgen_kv": {"auto": run("float32", 8192, 100.0), "int8": run("int8", 2176, 150.0)}}
    ]  # fmt: skip
    table = bench.format_kv_table(results, 1 << 30)
    line = next(ln for ln in table.splitlines() if ln.startswith("K") and "int8" in ln)
    assert "493440" in line and "3.76x" in line and "1.50x" in line, table


def test_workload_k_is_long_context(bench):
    class OneTokenPerWord:  # every word (with or without its space) is one token
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[0] for _ in texts]}

    w = bench.make_workload(OneTokenPerWord(), "K", scale=0.25)
    assert (w.n, w.max_tokens, w.rows, w.model) == (4, 128, 2, "long")
    # + BOS: 1,500-3,000 tokens
    assert all(1500 - 1 <= len(p.split()) <= 3000 - 1 for p in w.prompts)
    assert bench.MODEL_SPECS["long"]["max_position_embeddings"] >= 3000 + 128


QWEN3_30B_A3B_LAYER = {
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "vocab_size": 151_936,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
}


def test_matmul_params_of_a_moe_count_the_active_experts(bench):
    cfg = QWEN3_30B_A3B_LAYER
    attn = 2048 * 4096 * 2 + 2 * 2048 * 512  # q, o; k, v
    active = 128 * 2048 + 8 * 3 * 2048 * 768  # router + the 8 experts a token uses
    assert bench.matmul_params(cfg) == 4 * (attn + active) + 2048 * 151_936


def test_moe_step_bytes_reads_the_experts_the_step_uses(bench):
    cfg = QWEN3_30B_A3B_LAYER
    expert = 3 * 2048 * 768
    one = bench.moe_step_bytes(cfg, 1, 2)
    every = bench.moe_step_bytes(cfg, 10_000, 2)
    # one sequence: its 8 experts per layer; thousands: all 128
    assert every - one == pytest.approx(2 * 4 * (128 - 8) * expert)
    assert one < bench.moe_step_bytes(cfg, 16, 2) < every


def test_workload_m_is_moe(bench):
    class OneTokenPerWord:
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[0] for _ in texts]}

    w = bench.make_workload(OneTokenPerWord(), "M", scale=1.0)
    assert (w.n, w.max_tokens, w.rows, w.model) == (2, 64, 64, "moe")
    assert all(100 - 1 <= len(p.split()) <= 300 - 1 for p in w.prompts)
    spec = bench.MODEL_SPECS["moe"]
    assert spec["arch"] == "qwen3_moe" and spec["config_overrides"]["num_experts"] == 128


def test_the_script_imports_with_the_standard_library_only(tmp_path):
    """vLLM's worker runs this file in vLLM's own venv, where batchgen (and torch's extras) are
    not installed: only the standard library may be imported at module level."""
    import subprocess

    probe = (
        "import sys, importlib.util\n"
        "spec = importlib.util.spec_from_file_location('b', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['b'] = m\n"
        "spec.loader.exec_module(m)\n"
        "bad = sorted(n.split('.')[0] for n in sys.modules if n.split('.')[0] in "
        "('batchgen', 'torch', 'transformers', 'pyarrow', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    # -I: isolated (no site-packages of this venv's cwd tricks); -S: no site, the stdlib alone
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe, str(_PATH)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_openvino_properties_follow_the_cpus_bf16(bench):
    """OpenVINO's users' dtype is vLLM's rule (bf16 where the CPU has amx_bf16 or avx512_bf16),
    and its KV cache is kept in that dtype (the CPU plugin's default is a u8 cache)."""
    for text, precision in [(CPUINFO, "bf16"), ("model name : AMD\nflags : avx2 avx512f\n", "f32")]:
        native = bench.parse_cpuinfo(text)["native_bf16"]
        dtype = bench.plan_dtypes(["users"], "bfloat16" if native else "float32", "users", native)
        assert bench.openvino_properties(dtype[0], 2) == {
            "INFERENCE_PRECISION_HINT": precision,
            "KV_CACHE_PRECISION": precision,
            "INFERENCE_NUM_THREADS": 2,
        }
    with pytest.raises(KeyError):
        bench.openvino_precision("int8")


def test_openvino_export_is_cached_beside_the_model_and_stamped(bench, tmp_path):
    model = tmp_path / "bench-out" / "model-smollm2"
    assert bench.openvino_export_dir(model) == tmp_path / "bench-out" / "ov-model-smollm2"
    stamp = bench.openvino_export_spec({"gguf": "x.gguf"})
    assert stamp["weight_format"] == "fp32" and stamp["task"] == "text-generation-with-past"
    assert stamp != bench.openvino_export_spec({"gguf": "y.gguf"})  # a new model: export again
    cmd = bench.openvino_export_command(tmp_path / ".venv-openvino", model, tmp_path / "dest")
    assert cmd[0] == str(tmp_path / ".venv-openvino" / "bin" / "optimum-cli")
    assert cmd[1:3] == ["export", "openvino"]
    assert cmd[cmd.index("--weight-format") + 1] == "fp32"
    assert cmd[cmd.index("--model") + 1] == str(model) and cmd[-1] == str(tmp_path / "dest")


def test_openvino_install_pins_the_cpu_torch_in_the_same_install(bench, tmp_path):
    steps = bench.openvino_install_steps(tmp_path / "v")
    install = next(s for s in steps if "install" in s)
    assert f"torch=={bench.TORCH_VERSION}" in install
    assert f"openvino-genai=={bench.OPENVINO_GENAI_VERSION}" in install
    assert f"optimum-intel[openvino]=={bench.OPTIMUM_INTEL_VERSION}" in install
    assert steps[-1][-1] == "torchvision" and "uninstall" in steps[-1]


def _result(bench, name, bg, ov, skipped=False):
    run = lambda t: {"ok": True, "tok_s": t, "wall_s": 1.0}  # noqa: E731
    r = {
        "name": name,
        "rows": 8,
        "n": 1,
        "work": {"output_tokens": 512, "ideal_computed_prompt_tokens": 100, "prompt_tokens": 100},
        "batchgen_auto_dtype": "bfloat16",
        "batchgen": {"bfloat16": run(bg)},
        "vllm_users_dtype": "bfloat16",
        "vllm_skipped": True,
        "vllm": {},
        "openvino_users_dtype": "bfloat16",
        "openvino_skipped": skipped,
        "openvino": {} if ov is None else {"bfloat16": run(ov)},
        "hf": {},
        "floor": {"bfloat16": {"tok_s": 1000.0}, "float32": {"tok_s": 250.0}},
        "fraction_of_floor": {"batchgen": {"bfloat16": bg / 1000.0}},
    }
    r["headline"] = bench.headline(r)
    return r


def test_format_table_shows_openvino_and_the_bg_over_ov_headline(bench):
    results = [
        _result(bench, "L", 174.0, 151.0),
        _result(bench, "LS", 356.0, 381.0),
        _result(bench, "K", 100.0, None, skipped=True),
    ]
    assert results[0]["headline"]["ratio_openvino"] == pytest.approx(174 / 151)
    assert results[1]["headline"]["met_openvino"] is False
    assert results[2]["headline"]["ratio_openvino"] is None
    table = bench.format_table(results)
    header = table.splitlines()[0]
    assert "OV tok/s" in header and "bg/OV" in header
    row = next(ln for ln in table.splitlines() if ln.startswith("L ("))
    assert "151*" in row and "1.15x" in row
    assert "L: bg/OV = batchgen bf16 174 tok/s / OpenVINO bf16 151 tok/s = 1.15x (met)" in table
    assert "LS: bg/OV" in table and "0.93x (NOT met)" in table
    assert "(OpenVINO GenAI does not run K)" in table


def test_the_openvino_worker_imports_the_stdlib_openvino_genai_and_pyarrow_only():
    """The worker runs in OpenVINO's venv: no batchgen, torch or transformers."""
    import ast

    path = _PATH.parent / "bench_openvino_worker.py"
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            tops.add(node.module.split(".")[0])
    assert tops - set(sys.stdlib_module_names) == {"openvino_genai", "pyarrow"}


def test_moe_figures_take_transformers_fastest_dtype_and_the_table_shows_each(bench):
    """bg/HF is over HF's fastest run (its best setting), each HF dtype in its own table row."""
    cfg = {
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "vocab_size": 100,
    }
    r = _result(bench, "M", 1500.0, None, skipped=True)
    r["hf"] = {
        "bfloat16": {"ok": True, "tok_s": 150.0},
        "float32": {"ok": True, "tok_s": 50.0},
    }
    m = bench.moe_figures(r, cfg, copy_bw=1e10)
    assert m["hf_dtype"] == "bfloat16" and m["vs_hf"] == pytest.approx(10.0)
    r["hf"]["float32"] = {"ok": False, "error": "boom"}
    assert bench.moe_figures(r, cfg, copy_bw=1e10)["vs_hf"] == pytest.approx(10.0)
    table = bench.format_table([r])
    rows = [ln for ln in table.splitlines() if "bf16" in ln or "fp32" in ln]
    assert "150" in rows[0] and "10.00x" in rows[0]
    assert "FAILED" in next(ln for ln in rows if ln.split()[0] == "fp32")
    assert "M HF fp32: boom" in table


@pytest.mark.parametrize("repeat, turns, expected", [
    (1, True, ["bg0", "vllm-b0", "ov-b0", "vllm-f0"]),
    (3, True, ["bg0", "vllm-b0", "ov-b0", "bg1", "vllm-b1", "ov-b1", "bg2", "vllm-b2", "ov-b2",
               "vllm-f0", "vllm-f1", "vllm-f2"]),
    (3, False, ["bg0", "bg1", "vllm-b0", "vllm-b1", "vllm-b2", "vllm-f0", "vllm-f1", "vllm-f2",
                "ov-b0", "ov-b1", "ov-b2", "bg2"]),
])  # fmt: skip
def test_batchgen_and_the_peers_take_turns(bench, monkeypatch, tmp_path, repeat, turns, expected):
    """With --repeat r, batchgen and each peer's users' dtype take their runs in turn; a peer's
    other dtype runs its r runs back to back after them. With --no-turns, batchgen runs
    ceil(r/2) times before the peers and the rest after them."""
    import argparse

    order: list[str] = []

    class Done(Exception):
        pass

    w = bench.Workload("A", "what", 1, 4, ids=[0], prompts=["a b"])
    monkeypatch.setattr(bench, "make_workload", lambda *a: w)
    monkeypatch.setattr(bench, "write_parquet", lambda *a: None)
    monkeypatch.setattr(
        bench, "workload_work", lambda *a: {"prompt_tokens": 2, "ideal_computed_prompt_tokens": 2}
    )
    monkeypatch.setattr(bench, "measure_mm_rates", lambda: {})

    def bg(session, w, model, data, k, bg_auto, bg_runs, kv_runs):
        order.append(f"bg{k}")
        bg_runs.setdefault("bfloat16", []).append({"k": k})
        return "bfloat16"

    monkeypatch.setattr(bench, "_batchgen_runs", bg)
    peers = {
        "vllm": [bench.Peer("vllm", "bfloat16", None), bench.Peer("vllm", "float32", None)],
        "openvino": [bench.Peer("openvino", "bfloat16", None)],
    }
    monkeypatch.setattr(bench, "_peers", lambda *a, **k: peers)
    name = {"vllm": "vllm", "openvino": "ov"}
    monkeypatch.setattr(
        bench, "_peer_turn", lambda p, k: order.append(f"{name[p.kind]}-{p.dtype[0]}{k}")
    )
    monkeypatch.setattr(bench, "_finish_peer", lambda p, ids: None)

    def stop(*a, **k):
        raise Done

    monkeypatch.setattr(bench, "median_run", stop)  # the medians come after every run
    args = argparse.Namespace(
        repeat=repeat, scale=1.0, no_hf=True, hf_real=False, no_vllm=False, no_openvino=False,
        no_turns=not turns,
    )  # fmt: skip
    session = bench.Session(
        args=args, out=tmp_path, models={"small": tmp_path}, bg_words=["auto"], kv_dtypes=["auto"],
        tokenizers={"small": lambda prompts, **k: {"input_ids": [[1, 2] for _ in prompts]}},
        native=True, vllm_users="bfloat16", vllm_dtypes=["bfloat16", "float32"],
        vllm_problem=None, openvino_dtypes=["bfloat16"], openvino_problem=None, rates=[],
    )  # fmt: skip
    with pytest.raises(Done):  # reached the medians: every run was made
        bench.bench_workload(session, "A")
    assert order == expected


FAKE_WORKER = """
import json, sys
spec = json.load(open(sys.argv[-1]))
if spec.get("fail"):
    print("RuntimeError: no engine here")
    sys.exit(3)
for k, _ in enumerate(sys.stdin):
    run = {"elapsed_s": 2.0, "output_tokens": 10 * (k + 1), "tok_s": 5.0 * (k + 1)}
    with open(spec["runs"], "a") as f:
        f.write(json.dumps(run) + "\\n")
json.dump({"startup_s": 0.5, "version": "fake"}, open(spec["result"], "w"))
"""


def test_peer_worker_makes_one_run_a_turn(bench, tmp_path):
    """A peer's worker stays up between turns, makes one run per turn and ends with its result
    (every run, the median one); a worker that fails says why in one line."""
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    worker = bench.PeerWorker(
        "fake", "float32", {"n": 1}, [sys.executable, str(script)], None, tmp_path / "w", 60
    )
    first = worker.turn()
    pid = worker.proc.pid
    assert first == {"elapsed_s": 2.0, "output_tokens": 10, "tok_s": 5.0, "ok": True}
    assert [worker.turn()["tok_s"] for _ in range(2)] == [10.0, 15.0]
    assert worker.proc.pid == pid and worker.proc.poll() is None  # the same process throughout
    res = worker.finish()
    assert res["ok"] and res["tok_s"] == 10.0 and res["startup_s"] == 0.5
    assert [r["tok_s"] for r in res["runs"]] == [5.0, 10.0, 15.0] and res["idle_cpu_s"] >= 0

    failing = bench.PeerWorker(
        "fake", "float32", {"fail": True}, [sys.executable, str(script)], None, tmp_path / "f", 60
    )
    assert failing.turn() is None and "exit 3: RuntimeError: no engine here" in failing.error
    res = failing.finish()
    assert not res["ok"] and "exit 3" in res["error"]


def test_cpu_isa_avx2_caps_the_environment_and_the_cpu(bench, monkeypatch, tmp_path):
    """--cpu-isa avx2: the caps of torch, oneDNN, MKL and batchgen go into the environment, and
    the CPU reads as AVX2-only (no native bf16: users' dtype fp32)."""
    import os

    monkeypatch.setattr(
        os, "environ", {k: v for k, v in os.environ.items() if k not in bench.AVX2_ENV}
    )
    monkeypatch.setattr(bench.Path, "read_text", lambda self, *a, **k: CPUINFO)
    assert bench.cpu_info()["native_bf16"] and bench.cpu_info()["isa_cap"] is None
    assert bench.parse_args(["--cpu-isa", "avx2"]).cpu_isa == "avx2"
    bench.apply_avx2_cap(tmp_path)
    assert all(os.environ[k] == v for k, v in bench.AVX2_ENV.items())
    info = bench.cpu_info()
    assert info["isa_cap"] == "avx2" and not info["native_bf16"]
    assert info["flags"]["avx2"] and not any(info["flags"][f] for f in bench.AVX512_FLAGS)
    assert "capped at AVX2" in bench.format_machine(info, {"rates": {}, "threads": 2}, "2.13.0")


def test_cpu_isa_avx2_gives_vllm_a_sitecustomize(bench, monkeypatch, tmp_path):
    """Under the cap vLLM's worker runs with a sitecustomize first on its PYTHONPATH, which
    answers torch.cpu's AVX-512 and AMX checks with False."""
    import argparse
    import os
    import subprocess

    monkeypatch.setattr(os, "environ", dict(os.environ))
    site = bench.apply_avx2_cap(tmp_path)
    fake_cpu = type("cpu", (), {"_is_avx512_supported": lambda: True})
    monkeypatch.setitem(sys.modules, "torch", type("torch", (), {"cpu": fake_cpu}))
    monkeypatch.setitem(sys.modules, "torch.cpu", fake_cpu)
    code = (site / "sitecustomize.py").read_text()
    exec(compile(code, "sitecustomize.py", "exec"), {})
    assert fake_cpu._is_avx512_supported() is False

    seen: dict = {}

    def run(cmd, **kw):
        seen.update(kw["env"])
        raise subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(bench.subprocess, "run", run)
    args = argparse.Namespace(
        out=tmp_path, vllm_omp_threads=None, threads=None, vllm_venv=tmp_path, vllm_timeout=1
    )
    res = bench._run_vllm_worker({}, tmp_path / "w", "float32", args)
    assert not res["ok"] and seen["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    assert seen["ONEDNN_MAX_CPU_ISA"] == "AVX2"
