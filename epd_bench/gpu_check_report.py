"""gpu_check.md: what `python -m epd_bench.gpu_check` recorded, as tables ready to paste, each with its command."""
from __future__ import annotations

from typing import Any

from epd_bench import report


def render_md(record: dict[str, Any]) -> str:
    """The whole gpu_check.md for the record that gpu_check.json holds."""
    steps = record["steps"]
    lines = [f"# GPU check, {record['date']} on {record['host']}", "", "```bash", record["command"], "```", "",
             f"{record['wall_s']} s in all.", "", "| step | ok | seconds | note |", "|---|---|---:|---|"]
    lines += [f"| {name} | {'yes' if s.get('ok') else '**no**'} | {s['seconds']} | {s.get('error', '')} |"
              for name, s in steps.items()]
    return "\n".join([*lines, *_env_lines(steps.get("env", {})), *_test_lines(steps.get("tests", {})),
                      *_feature_lines(steps), *_serve_lines(steps, record["workload"])]) + "\n"


def _env_lines(env: dict[str, Any]) -> list[str]:
    keys = ("python", "torch", "torch_cuda", "cuda_available", "gpu", "capability", "gpu_count", "gpus",
            "transformers_from")
    lines = ["", "## Environment", "", "| what | value |", "|---|---|"]
    lines += [f"| {k} | {env[k]} |" for k in keys if k in env]
    return lines + [f"| {k} | {v} |" for k, v in env.get("packages", {}).items()]


def _test_lines(tests: dict[str, Any]) -> list[str]:
    if "passed" not in tests:
        return ["", "## Tests", "", f"not run: {tests.get('error', '?')}"]
    lines = ["", "## Tests", "", "```bash", tests["command"], "```", "", "| passed | failed | errors | skipped |",
             "|---:|---:|---:|---:|", f"| {tests['passed']} | {tests['failed']} | {tests['errors']} | {tests['skipped']} |"]
    return lines + [f"- {f}" for f in tests["failures"]]


def _serve_lines(steps: dict[str, Any], workload_title: str) -> list[str]:
    systems = {n: s for n, s in steps.items() if "processes" in s}
    if not systems:
        return []
    results = {n: s.get("result", {"completed": 0, "failed": "?"}) for n, s in systems.items()}
    lines = ["", f"## Serving: {workload_title}", "", "Each row: one system on the device, then this epd-bench "
             "command against it (`--base-url`/`--model`/`--label` per system):", ""]
    lines += [f"```bash\n{s['bench_command']}\n```" for s in list(systems.values())[:1] if "bench_command" in s]
    lines += ["", *report.workload_table({"results": {"w": results}}, "w"), "",
              "| system | start-up (s) | peak GPU memory per process (MiB) | GPU memory used, peak (MiB) |",
              "|---|---:|---|---:|"]
    for name, s in systems.items():
        mem = ", ".join(f"{p} {m}" for p, m in s.get("gpu_mib", {}).items()) or (s.get("gpu_sampler_error") or "–")
        lines.append(f"| {name} | {s.get('startup_s', '–')} | {mem} | {s.get('gpu_used_peak_mib') or '–'} |")
    lines += ["", "Processes:", ""]
    return lines + [f"- {n} {p}: `{cmd}`" for n, s in systems.items() for p, cmd in s["processes"].items()]


def _feature_lines(steps: dict[str, Any]) -> list[str]:
    """Constrained / free decoding at 16 streams, and the prefill saved by n = 4 (issue 14's benchmark rows)."""
    lines: list[str] = []
    if (st := steps.get("structured", {}).get("result")) is not None:
        lines += ["", "## Structured outputs: constrained / free decoding", "", "```bash",
                  steps["structured"]["command"], "```", "", "| streams | free tokens/s | constrained tokens/s | ratio "
                  "| mask µs/token |", "|---:|---:|---:|---:|---:|",
                  f"| {st['streams']} | {st['free_tokens_per_s']} | {st['constrained_tokens_per_s']} | {st['ratio']} "
                  f"| {st['mask_us_per_token']} |"]
    if (nf := steps.get("n-prefill", {}).get("result")) is not None:
        n4, n1 = nf["n_prefill"]["n=4 (one request)"], nf["n_prefill"]["4 x n=1"]
        kv = nf["kv_to_a_second_slot"]
        lines += ["", f"## Prefill saved by n = 4 ({nf['prompt_tokens']}-token prompt, {nf['device']})", "", "```bash",
                  steps["n-prefill"]["command"], "```", "", "| | prompt tokens prefilled | all 4 first tokens (ms) |",
                  "|---|---:|---:|",
                  f"| one request, n = 4 | {n4['prompt_tokens_prefilled']} | {n4['first_token_of_all_4_ms']} |",
                  f"| four requests, n = 1 | {n1['prompt_tokens_prefilled']} | {n1['first_token_of_all_4_ms']} |", "",
                  f"K/V to a second slot: copy {kv['copy_ms']} ms, prefill again {kv['prefill_ms']} ms."]
    return lines
