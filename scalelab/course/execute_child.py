"""The child side of `execute_notebook` (course/execute.py): run papermill once, in a process of its own that the
parent can stop, and write {"status", "message"} to the job's result file.

The kernel is this interpreter unless the job names one (a kernelspec found through JUPYTER_PATH, set in this
process only), and with `output_limit` papermill runs on an nbclient engine that cuts each cell's output as it
arrives."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

SELF_KERNEL = "scalelab-this-python"


def main(job_file: str) -> None:
    """Entry point of the child process: run papermill once and write {"status", "message"} to job['result']."""
    job = json.loads(Path(job_file).read_text())
    with tempfile.TemporaryDirectory(prefix="scalelab-kernel-") as kdir:
        kernel_name = job["kernel_name"]
        if kernel_name is None:
            kernel_name = _install_self_kernel(Path(kdir))
        outcome = _papermill(job, kernel_name)
    tmp = Path(job["result"] + ".tmp")
    tmp.write_text(json.dumps(outcome))
    tmp.replace(job["result"])  # atomic: the parent never reads half a result


def _install_self_kernel(root: Path) -> str:
    """A kernelspec for sys.executable, found first through JUPYTER_PATH (inherited by this process only)."""
    spec = root / "kernels" / SELF_KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})", "language": "python"}))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")]))
    return SELF_KERNEL


def _papermill(job: dict, kernel_name: str) -> dict:
    import traceback
    import papermill
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    engine = {}
    if job.get("output_limit"):
        engine = {"engine_name": _register_capped_engine(), "output_limit": int(job["output_limit"])}
    if job.get("continue_on_error"):
        engine["allow_errors"] = True  # nbclient runs every cell; papermill still reports the first error
    try:
        papermill.execute_notebook(job["input"], job["output"], parameters=job["parameters"], cwd=job["cwd"],
                                   kernel_name=kernel_name, execution_timeout=job["cell_timeout"],
                                   progress_bar=False, log_output=False, **engine)
        return {"status": "ok"}
    except papermill.PapermillExecutionError as e:
        return {"status": "cell_error", "message": f"{e.ename}: {e.evalue}"}
    except CellTimeoutError as e:
        return {"status": "cell_timeout", "message": str(e)}
    except DeadKernelError as e:
        return {"status": "dead_kernel", "message": str(e)}
    except Exception as e:  # a harness problem (no such kernel, kernel never started): the parent raises it
        return {"status": "internal", "message": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}


CAPPED_ENGINE = "scalelab-capped-output"


def _register_capped_engine() -> str:
    """Register (in this child process) papermill's nbclient engine with outputs capped per cell as they arrive."""
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.engines import NBClientEngine, papermill_engines
    from papermill.log import logger
    from papermill.utils import merge_kwargs, remove_args
    from ..record import MIME

    class CappedClient(PapermillNotebookClient):
        def __init__(self, nb_man, output_limit: int, **kw):
            super().__init__(nb_man, **kw)
            self._limit, self._sizes = output_limit, {}

        def output(self, outs, msg, display_id, cell_index):
            kind, content = msg["msg_type"], msg.get("content", {})
            used = self._sizes.get(cell_index, 0)
            if kind == "stream":
                text = content.get("text", "")
                if used >= self._limit:
                    return None
                self._sizes[cell_index] = used + len(text)
                if used + len(text) > self._limit:
                    text = (text[:self._limit - used] + f"\n[... more output cut by the grader while the notebook "
                            f"ran: at most {self._limit:,} characters per cell are kept ...]\n")
                    msg = {**msg, "content": {**content, "text": text}}
            elif kind in ("display_data", "execute_result", "update_display_data"):
                data = content.get("data", {})
                if MIME not in data and len(json.dumps(data, default=str)) > self._limit:
                    note = f"[output of {len(json.dumps(data, default=str)):,} characters cut by the grader]"
                    msg = {**msg, "content": {**content, "data": {"text/plain": note}}}
            return super().output(outs, msg, display_id, cell_index)

    class CappedEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, stdout_file=None,
                                     stderr_file=None, start_timeout=60, execution_timeout=None, **kwargs):
            limit = kwargs.pop("output_limit")
            kwargs = remove_args(["input_path", "timeout", "startup_timeout"], **kwargs)
            final = merge_kwargs(kwargs, timeout=execution_timeout, startup_timeout=start_timeout,
                                 kernel_name=kernel_name, log=logger, log_output=log_output, stdout_file=stdout_file,
                                 stderr_file=stderr_file)
            return CappedClient(nb_man, limit, **final).execute()

    papermill_engines.register(CAPPED_ENGINE, CappedEngine)
    return CAPPED_ENGINE


__all__ = ["main", "SELF_KERNEL", "CAPPED_ENGINE"]
