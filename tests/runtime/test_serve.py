"""`polar serve` / VLLMServer: command line, environment, and the error paths (fast unless marked)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from polar_core import paths
from polar_core.net import free_port, port_in_use
from polar_runtime.serve import LENIENT_PARSER, ServeError, VLLMServer, VLLMStartError, auto_kv_cache_gib, cpu_bind_spec

POLAR = [sys.executable, "-m", "polar_runtime.cli"]


def test_cpu_bind_spec():
    assert cpu_bind_spec({0, 1}) == "0-1"
    assert cpu_bind_spec({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpu_bind_spec({3}) == "3"
    assert cpu_bind_spec() == cpu_bind_spec(set(os.sched_getaffinity(0)))


def test_free_port_and_port_in_use():
    port = free_port()
    assert not port_in_use(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert port_in_use(port)


def test_cpu_command_and_environment(tiny_qwen_dir, smollm_dir, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    s = VLLMServer("tiny-qwen", port=18555, kv_cache_gib=1.5, gpu=False)
    cmd = s.command()
    assert cmd[:3] == [str(paths.vllm_python()), "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    assert f"--model {tiny_qwen_dir}" in joined and "--served-model-name tiny-qwen" in joined
    assert "--dtype float32 --enforce-eager" in joined and "--port 18555" in joined
    # the demo's parser by default (Hermes tags and Markdown JSON blocks), loaded as a plugin by path
    assert f"--enable-auto-tool-choice --tool-parser-plugin {LENIENT_PARSER} --tool-call-parser polar_lenient" in joined
    assert LENIENT_PARSER.is_absolute() and LENIENT_PARSER.is_file()
    hermes = " ".join(VLLMServer("tiny-qwen", port=18557, kv_cache_gib=1, gpu=False, tool_parser="hermes").command())
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in hermes and "--tool-parser-plugin" not in hermes
    off = VLLMServer("tiny-qwen", port=18558, kv_cache_gib=1, gpu=False, tool_parser="none").command()
    assert "--enable-auto-tool-choice" not in off and "--tool-call-parser" not in off
    assert "--max-model-len 32768" in joined
    # whole prompts in one prefill step on CPU (seeded requests crash a chunked prefill there)
    assert "--no-enable-chunked-prefill --max-num-batched-tokens 32768" in joined
    env = s.environment()
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and f"--kv-cache-memory-bytes {3 * 2**29}" in joined
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_bind_spec()
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(paths.vllm_cache_dir()) and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "HTTPS_PROXY" not in env  # the server must never send its own traffic to a proxy
    assert s.base_url == "http://127.0.0.1:18555" and s.openai_base_url.endswith(":18555/v1")
    assert s.log_path.parent == paths.vllm_cache_dir() / "logs"

    smol = VLLMServer(smollm_dir, port=18556, kv_cache_gib=2, gpu=False)
    assert smol.environment()["VLLM_CPU_KVCACHE_SPACE"] == "2" and "--kv-cache-memory-bytes" not in smol.command()
    assert "--enable-auto-tool-choice" not in smol.command()  # ChatML template without tools
    assert smol.served_model_name == "smollm2-135m-instruct"
    assert "--max-model-len 8192" in " ".join(smol.command())

    # automatic KV size: two full-length float32 sequences, at least 0.25 GiB
    assert auto_kv_cache_gib(tiny_qwen_dir, 32768) == 0.25  # 2 layers x 1 KV head x 64 x 2 x 4 B
    assert VLLMServer("tiny-qwen", port=18558, gpu=False).kv_cache_gib == 0.25
    assert auto_kv_cache_gib(smollm_dir, 8192) == 0.75  # 30 layers x 3 KV heads x 64 x 2 x 4 B = 45 KiB/token

    gpu = VLLMServer("tiny-qwen", port=18557, gpu=True)
    assert "--dtype bfloat16" in " ".join(gpu.command()) and "--enforce-eager" not in gpu.command()
    assert "--no-enable-chunked-prefill" not in gpu.command()
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu.environment()


def test_cli_refuses_a_taken_port(tiny_qwen_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([*POLAR, "serve", "tiny-qwen", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"port {port}" in proc.stderr and "already in use" in proc.stderr


def test_cli_reports_a_missing_model(tmp_path):
    env = dict(os.environ, POLAR_HOME=str(tmp_path))
    proc = subprocess.run([*POLAR, "serve", "tiny-qwen", "--port", str(free_port())], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "polar models build tiny-qwen" in " ".join(proc.stderr.split())
    proc = subprocess.run([*POLAR, "serve", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "config.json" in proc.stderr


def test_attach_needs_a_live_server(tiny_qwen_dir):
    with pytest.raises(ServeError, match="no vLLM serving"):
        VLLMServer.attach(f"http://127.0.0.1:{free_port()}", tiny_qwen_dir, served_model_name="tiny-qwen")


@pytest.mark.vllm
def test_vllm_dying_at_start_up_shows_its_log(tiny_qwen_dir, tmp_path):
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for f in tiny_qwen_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, broken / f.name)
    server = VLLMServer(broken, served_model_name="broken", kv_cache_gib=1, log_path=tmp_path / "vllm.log")
    with pytest.raises(VLLMStartError, match="exited with code") as info:
        server.start(wait=True, timeout=300)
    assert str(tmp_path / "vllm.log") in str(info.value)
    # the worker's root cause sits far above the API server's last lines; it must be shown
    assert f"RuntimeError: Cannot find any model weights with `{broken}`" in str(info.value)
    assert not server.running and not port_in_use(server.port)
    assert json.loads((broken / "config.json").read_text())["model_type"] == "qwen2"


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.vllm
def test_cli_sigterm_stops_the_whole_server(tiny_qwen_dir, tmp_path):
    """SIGTERM (as from a supervisor) during start-up must take vLLM's process group with it."""
    import signal
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    kids: list[int] = []
    proc = subprocess.Popen([*POLAR, "serve", "tiny-qwen", "--port", str(free_port()), "--kv-cache-gib", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not kids and time.monotonic() < deadline:
            time.sleep(0.2)
            kids = _children(proc.pid)
        assert kids, "polar serve never started vLLM"
        vllm_pid = kids[0]
        assert os.getpgid(vllm_pid) == vllm_pid  # its own group, so stop() can kill all of it
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        with pytest.raises(ProcessLookupError):
            os.killpg(vllm_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in kids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_failure_report_finds_root_causes_of_this_run_only(tiny_qwen_dir, tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) ERROR 11-30 07:00:00 [core.py:1] ValueError: from an earlier run\n")
    server = VLLMServer(tiny_qwen_dir, port=free_port(), log_path=log)
    server._log_offset = log.stat().st_size  # what start() records before appending
    with log.open("a") as fh:
        fh.write(
            "(EngineCore pid=2) ERROR 11-30 07:57:53 [multiproc_executor.py:315] Worker proc VllmWorker-0 died"
            " unexpectedly (exit code: -9), shutting down executor.\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "RuntimeError: cancelled\nRuntimeError: cancelled\n[shutdown] done\n"
        )
    lines = server.error_lines()
    assert lines[0].startswith("Worker proc VllmWorker-0 died unexpectedly") and "OOM killer" in lines[0]
    assert lines[1:] == ["RuntimeError: cancelled"]
    report = server.failure_report("vLLM exited (code 0)")
    assert "earlier run" not in report and report.rstrip().endswith("[shutdown] done")


def test_failure_report_names_a_config_check_message(tiny_qwen_dir, tmp_path):
    """vLLM refuses a config through pydantic, whose ValidationError line names no cause; the
    message is on the indented line below it (a max_model_len above the model's, as a user who
    picks SmolLM2 under the demo's 16,384 gets). The summary must carry that message."""
    log = tmp_path / "vllm.log"
    log.write_text(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (16384) is greater than the derived max_model_len"
        " (max_position_embeddings=8192.0 or model_max_length=None in model's config.json)."
        " [type=value_error, input_value=ArgsKwargs((), {'model': '/m'}), input_type=ArgsKwargs]\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n"
    )
    server = VLLMServer(tiny_qwen_dir, port=free_port(), log_path=log)
    lines = server.error_lines()
    assert lines[0].startswith("pydantic_core._pydantic_core.ValidationError")
    assert lines[1].startswith("Value error, User-specified max_model_len (16384)") and lines[1].endswith("config.json).")


@pytest.mark.vllm
def test_seeded_long_prompts_do_not_take_the_cpu_server_down(vllm_tiny):
    """Polar seeds every call (polar_sampling). On CPU, vLLM 0.32 kills its engine when a seeded
    prompt is prefilled in chunks (it rewinds the request's generator, which CPU generators refuse):
    with vLLM's default 2,048-token chunks a 6,000-token seeded prompt ended the server. Two such
    prompts at once, next to a short one, must all be answered and leave the server up."""
    from concurrent.futures import ThreadPoolExecutor

    from polar_core.net import http_json

    def ask(words: int, seed: int) -> dict:
        body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "word " * words}],
                "max_tokens": 4, "seed": seed, "temperature": 1.0}
        return http_json(vllm_tiny.openai_base_url + "/chat/completions", body, timeout=300)

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, [6000, 5000, 10], [1, 2, 3]))
    assert [a["usage"]["prompt_tokens"] > n for a, n in zip(answers, [6000, 5000, 10])] == [True] * 3
    assert all(a["choices"][0]["finish_reason"] in ("length", "stop") for a in answers)
    assert ask(10, 4)["choices"]  # still serving
