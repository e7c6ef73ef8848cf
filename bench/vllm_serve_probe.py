"""Does `vllm serve` (VLLM_SERVER_DEV_MODE=1) of the installed vLLM serve what lit-ppo's rollout workers need?

One bounded experiment (issue 38 item 3, docs/async.md "vLLM servers as rollout workers (investigation)"): builds the
tests' tiny Qwen2 model, samples a batch with lit-ppo's in-process engine (`VLLMEngine`, the reference), starts ONE
`vllm serve` of the same model with the CPU settings `VLLMEngine` passes to `LLM(...)` (under `timeout`), probes it
over HTTP, stops it, and prints one line per capability: PASS / FAIL and what was seen.

    .venv/bin/python bench/vllm_serve_probe.py                 # about 4 minutes on 2 shared CPU cores
    .venv/bin/python bench/vllm_serve_probe.py --keep-dir      # keeps the model, adapters and server.log

Probed: token ids in and out (/v1/completions and /inference/v1/generate), per-request seeds (reproducible, and equal
to the in-process engine's samples and processed log-probs), pause/resume, a full-weight push through a weight-transfer
engine registered by a plugin (bench/vllm_serve_probe_plugin.py: gloo, since vLLM's own engines need CUDA), the
weight version (/update_weight_version, /weight_info, per-token `weight_versions`), /weight_checker, and LoRA adapters
(/v1/load_lora_adapter)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
SERVER_ENV = dict(os.environ)  # before VLLMEngine's setdefaults (in-process settings) touch os.environ

from vllm_serve_probe_plugin import BACKEND, broadcast, gloo_group  # noqa: E402

LORA_RANK = 8
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256(b"")
SERVED_NAME = "policy"  # --served-model-name: the base model's name in requests
SAMPLING = dict(n=2, temperature=1.0, top_p=0.9, max_tokens=12)
LOGPROB_TOLERANCE = 1e-4  # nats per token, float32 on both sides
RESULTS: list[tuple[str, bool, str]] = []


def record(capability: str, ok: bool, detail: str) -> None:
    RESULTS.append((capability, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {capability}: {detail}", flush=True)


def probe(capability: str):
    """Runs one probe; an exception is its FAIL line (the error, short), never the end of the experiment."""

    def wrap(fn):
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - every failure is a finding
                record(capability, False, f"{type(error).__name__}: {str(error)[:300]}")
                return None

        return run

    return wrap


# --------------------------------------------------------------------------------------------------- models


def build_models(root: Path):
    """The tests' tiny model (tests/conftest.py's shape) as policy A (on disk, what the server loads), a second one
    (seed 1) as the pushed policy B, and two LoRA adapters on A saved as peft directories."""
    from peft import LoraConfig, get_peft_model

    from lit_ppo.demo.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    shape = dict(
        hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=128
    )
    model_a = build_tiny_model(tokenizer, seed=0, **shape).eval()
    model_b = build_tiny_model(tokenizer, seed=1, **shape).eval()
    model_dir = save_model_dir(model_a, tokenizer, root / "model")
    adapters = {}
    for version in (1, 2):
        base = build_tiny_model(tokenizer, seed=0, **shape)
        config = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], bias="none")
        peft_model = get_peft_model(base, config)
        torch.manual_seed(100 + version)
        with torch.no_grad():  # lora_B starts at zero: give each version a real effect
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
        path = root / f"adapter_v{version}"
        peft_model.save_pretrained(path)
        adapters[version] = (path, peft_model.eval())
    return tokenizer, model_dir, model_a, model_b, adapters


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> list[float]:
    """Teacher-forced log-probs of ids[1:] (temperature 1): what the trainer computes."""
    logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[j - 1, ids[j]].item() for j in range(1, len(ids))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


# --------------------------------------------------------------------------------------------------- server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> str:
    return str(Path(sys.executable).with_name("vllm"))


@probe("the `vllm` command starts (`vllm --version`)")
def check_vllm_cli() -> bool:
    """The `vllm serve` entry point; where it fails, the server is started as `python -m
    vllm.entrypoints.openai.api_server` (the same server, same arguments)."""
    done = subprocess.run([vllm_cli(), "--version"], capture_output=True, text=True, timeout=120)
    last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    record("the `vllm` command starts (`vllm --version`)", done.returncode == 0, f"code {done.returncode}: {last[0]}")
    return done.returncode == 0


def server_command(model_dir: Path, port: int, lifetime_s: int, cli: bool) -> list[str]:
    """`vllm serve` with what `VLLMEngine` passes to `LLM(...)` on CPU (lit_ppo/rollout/engine.py), plus the server's
    own: the scale-out (token-in, token-out) route, LoRA as a LoRA run has it, and the plugin's weight-transfer engine."""
    if cli:
        launch = [vllm_cli(), "serve", str(model_dir)]
    else:
        launch = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    return [
        "timeout", str(lifetime_s), *launch,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
        "--dtype", "float32", "--max-model-len", "128", "--seed", "0", "--enforce-eager",
        "--no-enable-chunked-prefill",  # CPU generators cannot rewind (engine.py)
        "--enable-prefix-caching",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",  # no sampling defaults from the model's generation_config.json
        "--enable-scale-out",  # /inference/v1/generate
        "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "1",
        "--weight-transfer-config", json.dumps({"backend": BACKEND}),
    ]  # fmt: skip


def start_server(model_dir: Path, port: int, root: Path, lifetime_s: int, cli: bool) -> tuple[subprocess.Popen, Path]:
    plugin_dir = root / "plugin"  # the entry point vLLM finds with importlib.metadata, nothing installed
    dist_info = plugin_dir / "lit_ppo_vserve_probe-0.0.0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: lit-ppo-vserve-probe\nVersion: 0.0.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{BACKEND} = vllm_serve_probe_plugin:register\n"
    )
    env = dict(SERVER_ENV)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_CPU_KVCACHE_SPACE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(plugin_dir), str(BENCH), env.get("PYTHONPATH", "")]),
    )
    log = root / "server.log"
    command = server_command(model_dir, port, lifetime_s, cli)
    print("$ VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=True " + " ".join(command), flush=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def wait_ready(process: subprocess.Popen, base: str, log: Path, timeout_s: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if process.poll() is not None:
            tail = log.read_text().splitlines()[-15:]
            raise RuntimeError(f"vllm serve exited with code {process.returncode}:\n" + "\n".join(tail))
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"vllm serve not ready within {timeout_s} s; see {log}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # its own session: timeout, vllm and vLLM's engine process
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


class Client:
    def __init__(self, base: str):
        self.base = base

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 120) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{method} {path} -> HTTP {error.code}: {error.read().decode()[:300]}") from None
        try:
            return json.loads(text) if text else {}
        except json.JSONDecodeError:  # /v1/load_lora_adapter answers in plain text
            return {"text": text}

    def post(self, path: str, body: dict | None = None, **kwargs) -> dict:
        return self.call("POST", path, body if body is not None else {}, **kwargs)

    def get(self, path: str, **kwargs) -> dict:
        return self.call("GET", path, **kwargs)


def concurrently(calls):
    """Runs the calls in threads (one HTTP request each, as a worker's client would), results in order."""
    results: list = [None] * len(calls)
    errors: list = []

    def run(i, call):
        try:
            results[i] = call()
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# --------------------------------------------------------------------------------------------------- probes


def samples_from_completions(responses, prompts) -> list[tuple[list[int], list[float], str]]:
    out = []
    for response, prompt in zip(responses, prompts):
        for choice in sorted(response["choices"], key=lambda c: c["index"]):
            if choice.get("prompt_token_ids") not in (None, prompt):
                raise AssertionError(f"prompt ids came back changed: {choice['prompt_token_ids']} != {prompt}")
            out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"]))
    return out


def samples_from_generate(responses) -> list[tuple[list[int], list[float], str]]:
    out = []
    for response in responses:
        for choice in sorted(response["choices"], key=lambda c: c["index"]):
            logprobs = [position["logprob"] for position in choice["logprobs"]["content"]]
            out.append((choice["token_ids"], logprobs, choice["finish_reason"]))
    return out


def compare_with_reference(samples, reference) -> tuple[bool, str]:
    tokens_equal = all(s[0] == r.token_ids for s, r in zip(samples, reference)) and len(samples) == len(reference)
    diff = max(max_abs_diff(s[1], r.logprobs) for s, r in zip(samples, reference))
    tokens = sum(len(s[0]) for s in samples)
    return tokens_equal and diff < LOGPROB_TOLERANCE, (
        f"{len(samples)} samples, {tokens} tokens, token ids equal to the in-process engine's: {tokens_equal}, "
        f"max |log-prob diff| {diff:.2e}"
    )


def completions_request(prompt: list[int], seed: int, stop_ids: list[int], **extra) -> dict:
    return dict(
        model=extra.pop("model", SERVED_NAME), prompt=prompt, seed=seed, logprobs=0, return_token_ids=True,
        stop_token_ids=stop_ids, **SAMPLING, **extra,
    )  # fmt: skip


def generate_request(prompt: list[int], seed: int, stop_ids: list[int]) -> dict:
    params = dict(SAMPLING, seed=seed, logprobs=0, stop_token_ids=stop_ids)
    return dict(token_ids=prompt, sampling_params=params)


def prompt_logprobs(client: Client, ids: list[int], model: str) -> list[float]:
    """The server's teacher-forced log-probs of ids[1:] (as VLLMEngine.sequence_logprobs asks the engine)."""
    body = dict(model=model, prompt=ids, max_tokens=1, temperature=0.0, prompt_logprobs=0, return_token_ids=True)
    per_position = client.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
    if per_position is None:  # some versions put it on the response
        raise AssertionError("no prompt_logprobs in the /v1/completions response")
    return [per_position[j][str(ids[j])]["logprob"] for j in range(1, len(ids))]


VLLM_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
VLLM_FUSED["up_proj"] = "gate_up_proj"


def expected_changes(model_a, model_b, checksums: dict[str, str]) -> set[str]:
    """The weight_checker keys whose tensors differ between A and B: HF names mapped to vLLM's fused ones."""
    b = dict(model_b.named_parameters())
    changed = set()
    for name, tensor in model_a.named_parameters():
        if not torch.equal(tensor, b[name]):
            module, _, leaf = name.rpartition(".")
            parent, _, proj = module.rpartition(".")
            changed.add(f"{parent}.{VLLM_FUSED.get(proj, proj)}.{leaf}")
    return {key for key in checksums if key.split(":")[-1].replace(".base_layer.", ".") in changed}


def push_full_weights(client: Client, named: list, version: str) -> tuple[int, float]:
    """The trainer's side of the plugin's gloo engine: rank 0 of the group, one broadcast per tensor while the server
    receives in /update_weights, between /start_weight_update and /finish_weight_update. `named`: (HF name, tensor)."""
    port = free_port()
    init = {"host": "127.0.0.1", "port": port, "rank": 1, "world_size": 2, "timeout_s": 60}
    started = time.perf_counter()
    pending = threading.Thread(target=lambda: client.post("/init_weight_transfer_engine", {"init_info": init}))
    pending.start()
    store, group = gloo_group("127.0.0.1", port, 0, 2, 60, True)
    pending.join()
    named = [(name, tensor.detach().contiguous()) for name, tensor in named]
    update = {
        "names": [name for name, _ in named],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
    }
    client.post("/start_weight_update")
    errors: list = []

    def receive():
        try:
            client.post("/update_weights", {"update_info": update})
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    receiving = threading.Thread(target=receive)
    receiving.start()
    for _, tensor in named:
        broadcast(group, tensor)
    receiving.join()
    if errors:
        raise errors[0]
    client.post("/finish_weight_update", {"weight_version": version})
    del group, store
    return sum(t.numel() * t.element_size() for _, t in named), time.perf_counter() - started


def run_probes(client: Client, tokenizer, model_a, model_b, adapters, prompts, seeds, stop_ids, reference) -> None:
    @probe("token ids in/out, seeds, processed log-probs (/v1/completions)")
    def completions():
        calls = [
            lambda p=p, s=s: client.post("/v1/completions", completions_request(p, s, stop_ids))
            for p, s in zip(prompts, seeds)
        ]
        first = samples_from_completions(concurrently(calls), prompts)
        second = samples_from_completions(concurrently(calls), prompts)
        ok, detail = compare_with_reference(first, reference)
        record("token ids in/out, seeds, processed log-probs (/v1/completions)", ok, detail)
        record(
            "same request + seed twice gives the same samples (/v1/completions)",
            first == second,
            f"identical: {first == second}",
        )

    @probe("token ids in/out, seeds, processed log-probs (/inference/v1/generate)")
    def generate():
        calls = [
            lambda p=p, s=s: client.post("/inference/v1/generate", generate_request(p, s, stop_ids))
            for p, s in zip(prompts, seeds)
        ]
        responses = concurrently(calls)
        ok, detail = compare_with_reference(samples_from_generate(responses), reference)
        record("token ids in/out, seeds, processed log-probs (/inference/v1/generate)", ok, detail)
        spans = responses[0]["choices"][0].get("weight_versions")
        record("per-token weight version in the response (/inference/v1/generate)", spans is not None, f"{spans}")

    @probe("pause (mode=keep) holds a request, resume releases it")
    def pause_resume():
        client.post("/pause?mode=keep")
        paused = client.get("/is_paused")["is_paused"]
        done = threading.Event()
        thread = threading.Thread(
            target=lambda: (
                client.post("/v1/completions", completions_request(prompts[0], seeds[0], stop_ids)),
                done.set(),
            )
        )
        thread.start()
        held = not done.wait(3.0)
        client.post("/resume")
        finished = done.wait(60)
        thread.join(60)
        resumed = not client.get("/is_paused")["is_paused"]
        ok = paused and held and finished and resumed
        record(
            "pause (mode=keep) holds a request, resume releases it",
            ok,
            f"/is_paused {paused}; request held 3 s while paused: {held}; done after /resume: {finished}",
        )

    @probe("weight_checker checksum")
    def checksum():
        checksums = client.post("/weight_checker", {"action": "checksum"})["checksums"]
        record("weight_checker checksum", bool(checksums), f"{len(checksums)} tensors' sha256")
        return checksums

    @probe("full-weight push through a registered engine (/init_weight_transfer_engine ... /finish_weight_update)")
    def push(baseline):
        ids = prompts[0] + reference[0].token_ids
        diff_a = max_abs_diff(prompt_logprobs(client, ids, SERVED_NAME), hf_logprobs(model_a, ids))
        # named_parameters() leaves out the tied lm_head.weight (it is embed_tokens.weight); state_dict() has both,
        # and it is what lit-ppo pushes (PPOModule.full_actor_tensors).
        for label, named, version in (
            ("named_parameters(), without the tied lm_head.weight", list(model_b.named_parameters()), "1"),
            ("state_dict(), as lit-ppo pushes", list(model_b.state_dict().items()), "2"),
        ):
            client.post("/pause?mode=wait")
            nbytes, seconds = push_full_weights(client, named, version)
            client.post("/resume")
            after = prompt_logprobs(client, ids, SERVED_NAME)
            diff_b = max_abs_diff(after, hf_logprobs(model_b, ids))
            record(
                f"full-weight push through a registered engine: {label}",
                diff_a < LOGPROB_TOLERANCE and diff_b < LOGPROB_TOLERANCE,
                f"backend {BACKEND}; {len(named)} tensors, {nbytes / 2**20:.2f} MiB in {seconds:.2f} s; server's "
                f"log-probs vs policy A before {diff_a:.1e}, vs pushed policy B after {diff_b:.1e}",
            )
        version = client.get("/weight_info")["weight_version"]
        record("finish_weight_update sets the version (/weight_info)", version == "2", f"/weight_info: {version!r}")
        client.post("/update_weight_version", {"new_version": "7"})
        version = client.get("/weight_info")["weight_version"]
        spans = client.post("/inference/v1/generate", generate_request(prompts[0], seeds[0], stop_ids))["choices"][0]
        record(
            "/update_weight_version then /weight_info",
            version == "7",
            f"/weight_info: {version!r}; generate's weight_versions: {spans.get('weight_versions')}",
        )
        if baseline is not None:
            compared = client.post("/weight_checker", {"action": "compare", "baseline": baseline})
            changed = expected_changes(model_a, model_b, baseline)
            empty = sorted(key for key, digest in baseline.items() if digest == EMPTY_SHA256)
            record(
                "weight_checker compare sees every pushed tensor that changed",
                set(compared["mismatches"]) == changed,
                f"{len(baseline)} keys (vLLM's names, e.g. {sorted(baseline)[1]!r}); mismatches "
                f"{sorted(compared['mismatches'])}, expected the {len(changed)} tensors A and B differ in; "
                f"{len(empty)} keys are the checksum of zero bytes (an empty tensor), e.g. {empty[:1]}",
            )

    @probe("LoRA adapter loaded at run time (/v1/load_lora_adapter, a directory)")
    def lora():
        ids = prompts[1] + reference[2].token_ids
        for version, (path, peft_model) in adapters.items():
            name = f"policy-v{version}"
            client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            served = [m["id"] for m in client.get("/v1/models")["data"]]
            diff = max_abs_diff(prompt_logprobs(client, ids, name), hf_logprobs(peft_model, ids))
            record(
                f"LoRA adapter v{version} loaded at run time (/v1/load_lora_adapter, a directory)",
                diff < LOGPROB_TOLERANCE,
                f"/v1/models: {served}; log-probs vs peft's {diff:.1e}",
            )
            client.post("/v1/unload_lora_adapter", {"lora_name": name})

    completions()
    generate()
    pause_resume()
    lora()  # before the push: the adapters were trained on policy A
    baseline = checksum()
    push(baseline)
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    fields = sorted(LoadLoRAAdapterRequest.model_fields)
    record(
        "LoRA adapter from memory (tensors, no directory)",
        False,
        f"no such route: /v1/load_lora_adapter takes {fields} (a path on the server's disk)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifetime-s", type=int, default=300, help="the server's `timeout` (it never outlives it)")
    parser.add_argument("--keep-dir", action="store_true", help="keep the model, adapters and server.log")
    args = parser.parse_args()
    import vllm

    from lit_ppo.contract import GenerateRequest
    from lit_ppo.rollout.engine import VLLMEngine

    root = Path(tempfile.mkdtemp(prefix="vllm_serve_probe_"))
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}; work directory {root}", flush=True)
    tokenizer, model_dir, model_a, model_b, adapters = build_models(root)
    texts = ["12+34=", "What is 7*8? ", "The capital of France is", "a"]
    prompts = [tokenizer.encode(text) for text in texts]
    seeds = [1234 + 2 * i for i in range(len(prompts))]  # n = 2 apart, as engine.sampling_seeds
    stop_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(".")]

    started = time.perf_counter()
    engine = VLLMEngine(str(model_dir), max_model_len=128, seed=0, max_lora_rank=LORA_RANK)
    reference = engine.generate(GenerateRequest(prompts, seeds=seeds, stop_token_ids=stop_ids, **SAMPLING))
    engine.close()
    print(f"in-process reference: {len(reference)} samples in {time.perf_counter() - started:.1f} s", flush=True)

    cli = bool(check_vllm_cli())
    port = free_port()
    process, log = start_server(model_dir, port, root, args.lifetime_s, cli)
    try:
        ready_s = wait_ready(process, f"http://127.0.0.1:{port}", log, args.lifetime_s - 30)
        record("the server starts (VLLM_SERVER_DEV_MODE=1)", True, f"ready in {ready_s:.0f} s")
        created = [line for line in log.read_text().splitlines() if "Creating weight transfer engine" in line]
        record(
            "the plugin's engine is created in the server's worker (--weight-transfer-config)",
            any("GlooWeightTransferEngine" in line for line in created),
            created[0].split("]")[-1].strip() if created else "no 'Creating weight transfer engine' line in the log",
        )
        run_probes(
            Client(f"http://127.0.0.1:{port}"),
            tokenizer,
            model_a,
            model_b,
            adapters,
            prompts,
            seeds,
            stop_ids,
            reference,
        )
    except Exception as error:  # noqa: BLE001
        record("the server starts (VLLM_SERVER_DEV_MODE=1)", False, str(error)[-600:])
    finally:
        stop_server(process)
        print(f"server stopped (code {process.returncode}); its log: {log}", flush=True)

    width = max(len(name) for name, _, _ in RESULTS)
    print(f"\n{'capability':<{width}}  result")
    for name, ok, _ in RESULTS:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}")
    if not args.keep_dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
