"""Downstream tasks through lm-evaluation-harness, on a loaded quantkit artifact or float checkpoint.

The model quantkit loads (QuantLinear modules, kernels on CUDA) is handed to lm-eval's Hugging Face
wrapper as an instance, so lm-eval scores exactly what `quantkit eval ppl` scores. Needs the optional
extra (`pip install quantkit[eval]`); tasks are lm-eval's own names or YAML definitions found under
`include_path` (local data files work offline).
"""

from quantkit.errors import QuantkitError


def evaluate_tasks(src, tasks, *, device=None, dtype=None, batch_size=1, limit=None, num_fewshot=None,
                   include_path=None, verify=True, bits=None, seed=0) -> dict:
    """{"model", "tasks": {task: {metric: value, metric_stderr: value}}, "n_samples", ...} for one model."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise QuantkitError("quantkit eval tasks needs lm-evaluation-harness: pip install 'quantkit[eval]'") from None

    from quantkit.pipeline import load_for_eval, resolve_device

    device = resolve_device(device)
    model, tokenizer, source = load_for_eval(src, device, dtype, verify, bits=bits)
    manager = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise QuantkitError(f"unknown lm-eval task {unknown[0]!r}" + (f" (looked in {include_path} too)"
                                                                        if include_path else ""))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
    out = simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                          fewshot_random_seed=seed, log_samples=False, bootstrap_iters=1000)
    metrics = {task: {key.split(",")[0]: value for key, value in values.items() if key != "alias"}
               for task, values in out["results"].items()}
    return {"model": source.display, "model_kind": source.kind, "tasks": metrics,
            "n_samples": {task: n.get("effective") for task, n in out.get("n-samples", {}).items()},
            "num_fewshot": num_fewshot, "limit": limit, "device": device,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            **({} if bits is None else {"served_bits": bits})}
