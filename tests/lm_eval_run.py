"""One lm-evaluation-harness task against a server, in a process of its own (lm-eval configures
logging and caches as it likes): `python tests/lm_eval_run.py MODEL_ARGS TASK_DIR TASK OUT_JSON`
writes {"results": the task's metrics, "samples": each item's logged requests and responses}.

Through lm-eval's Python API rather than its CLI, so that the task manager indexes only the
task's folder: indexing lm-eval's own task files (thousands of YAML files) is most of a CLI
run's time, and this test needs none of them."""
import json
import sys

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager


def main(model_args: str, task_dir: str, task: str, out_path: str) -> None:
    evaluated = simple_evaluate(model="local-completions", model_args=model_args, tasks=[task], log_samples=True,
                                task_manager=TaskManager(include_path=task_dir, include_defaults=False))
    samples = [{key: sample[key] for key in ("doc_id", "doc", "resps")} for sample in evaluated["samples"][task]]
    with open(out_path, "w") as f:
        json.dump({"results": evaluated["results"][task], "samples": samples}, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
