"""lm-evaluation-harness tasks against a server, in a process of its own (lm-eval configures
logging and caches as it likes): `python tests/lm_eval_run.py TASK_DIR TASK OUT_JSON MODEL_ARGS...`
runs the task once per MODEL_ARGS, in order, and writes a list with, for each run, {"results":
the task's metrics, "samples": each item's logged requests and responses}.

Through lm-eval's Python API rather than its CLI, so that the task manager indexes only the
task's folder: indexing lm-eval's own task files (thousands of YAML files) is most of a CLI
run's time, and this test needs none of them. The runs share one process: importing lm-eval
and what it imports costs more than a run."""
import json
import sys

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager


def main(task_dir: str, task: str, out_path: str, *runs: str) -> None:
    task_manager = TaskManager(include_path=task_dir, include_defaults=False)
    out = []
    for model_args in runs:
        evaluated = simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                    log_samples=True, task_manager=task_manager)
        samples = [{key: sample[key] for key in ("doc_id", "doc", "resps")} for sample in evaluated["samples"][task]]
        out.append({"results": evaluated["results"][task], "samples": samples})
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
