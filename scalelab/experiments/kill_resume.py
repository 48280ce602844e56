"""Lab 06's kill test: a training process runs the student's save, is killed in the middle of one, and fresh
processes resume with the student's restore; the test's files and logs say whether a partial checkpoint was ever
loaded and whether the resumed run is the uninterrupted one, bit for bit.

The student writes, in a module beside the notebook (`my_ckpt.py`):

    save(directory, step, model, optimizer)      # atomic: temp file, fsync, rename, fsync the folder; then the
                                                 # manifest (same way) with every checkpoint's crc32
    restore(directory, model, optimizer) -> int  # the newest checkpoint the manifest lists whose bytes match its
                                                 # checksum, into model, optimizer and the RNG; its step (0: none)

A checkpoint is `step-<8 digits>.pt`, torch.save of {"step", "model", "optimizer", "rng"}, and `manifest.json` is
{"checkpoints": [{"step", "file", "checksum": "crc32:<8 hex>", "bytes"}, ...]}, oldest first: the engine's own
format (scalelab.ckpt), so the student's restore also reads checkpoints the engine wrote.

`kill_and_resume("my_ckpt", out)` starts one process (`python -m scalelab.experiments.kill_resume`) that imports
torch once and forks a fresh process for each part (whole first; crash beside planted; resume once crash is dead):

    whole    trains `steps` steps without a break (the engine's save every `every` steps): the reference
    crash    the same training with the student's save; the save of step `kill_at` is killed by the kernel the
             moment it writes byte `kill_bytes` of any file (RLIMIT_FSIZE: SIGXFSZ, as abrupt as a SIGKILL at
             that instant: nothing of the process runs after it). Its folder is then copied to `after-kill/`
    resume   a fresh process: the student's restore on what the kill left, then on to `steps`, saving as before
    planted  a fresh process: the student's restore on a folder of the whole run's checkpoints where the newest
             listed one has a flipped bit, an unlisted half-written `step-<kill_at>.pt` lies beside them (what a
             save that writes in place leaves) and a stray temp file; then on to `steps`

Every worker writes `log.jsonl` in its folder: each step's loss, a SHA-256 of the whole training state (weights,
optimizer, RNG) at every checkpoint step and at the end, what each restore loaded (the crc32 of the bytes
torch.load was given, matched to the files), and the file operations of each save of the student's (open, fsync,
rename: an audit hook and a wrapped os.fsync see them however the student writes). A process kill cannot show a
missing fsync (the page cache outlives the process; only a power cut loses it), so the order of those operations is
checked from the log. `verdict(...)` works out everything from those files alone; the grader re-reads them with it.
Training is an MLP with dropout on batches drawn from the global RNG, one thread, on the CPU: a restore that forgets
the momentum or the RNG state resumes on different numbers.
"""
from __future__ import annotations

import argparse
import builtins
import hashlib
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

from ..ckpt.sync import save_checkpoint
from ..paths import json_lines, read_beneath
from .own_code import load_own

LOG = "log.jsonl"
CKPT = "checkpoints"
AFTER_KILL = "after-kill"
MANIFEST = "manifest.json"
ROLES = ("whole", "crash", "resume", "planted")
WORKER_TIMEOUT_S = 240.0
"""The whole test's limit (it takes a few seconds: one import of torch, four short trainings)."""
MAX_FILE_BYTES = 16 * 2**20


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at `step` (the engine's)."""
    return f"step-{step:08d}.pt"


def crc32_of(data: bytes) -> str:
    """'crc32:<8 hex digits>', the manifest's checksum format."""
    return f"crc32:{zlib.crc32(data):08x}"


# -- the experiment (the notebook's process) --------------------------------------------------------------------
def kill_and_resume(module: str, out_dir, steps: int = 20, every: int = 4, kill_at: int = 12, width: int = 256,
                    source_dir=None) -> dict:
    """Run the kill test on the student's `module` (save and restore in `<module>.py` beside the notebook) in
    out_dir; returns `verdict` of what the workers left, with `run_dir`. A function not written yet is reported
    (`save_error`, `restore_error`: "not written yet") and the other parts still run."""
    if not (every > 0 and kill_at % every == 0 and 3 * every <= kill_at < steps):
        raise ValueError(f"kill_at = {kill_at} must be a multiple of every = {every}, at least 3 x every (two "
                         f"complete checkpoints before it, one of them corrupted in the planted folder) and below "
                         f"steps = {steps}")
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    code = {}
    for name in ("save", "restore"):  # copies <module>.py into out/code/ and checks that both functions exist
        _, code = load_own(f"{module}:{name}", out, source_dir)
    args = dict(module=module, steps=steps, every=every, kill_at=kill_at, width=width, code=code)
    cmd = [sys.executable, "-m", "scalelab.experiments.kill_resume", "--out", str(out.resolve()),
           "--args", json.dumps(args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(out / "stdout.txt", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the test's own process group: the server and its children
            proc.wait()
            raise TimeoutError(f"the kill test did not finish in {WORKER_TIMEOUT_S:.0f} s; see {out / 'stdout.txt'}")
    return {"run_dir": str(out), **verdict(lambda rel: _read_file(out / rel))}


def serve(out: Path, args: dict) -> None:
    """The kill test's processes, each forked from this one once it has imported torch (so a fresh process costs
    no second import): the whole run; then the crash run beside the planted restore; then, if the crash run was
    killed in the middle of a save, the resume from what it left (copied first to after-kill/)."""
    def wait(role, pid):
        status = os.waitpid(pid, 0)[1]
        rc = os.waitstatus_to_exitcode(status)
        with open(out / role / LOG, "a") as f:
            f.write(json.dumps({"type": "exit", "returncode": rc,
                                "signal": signal.Signals(-rc).name if rc < 0 else None}) + "\n")

    wait("whole", _fork(out, "whole", args))
    crash, planted = _fork(out, "crash", args), _fork(out, "planted", args)
    wait("crash", crash)
    crash_dir = out / "crash" / CKPT
    if crash_dir.is_dir():  # the evidence of the kill, kept before the resumed run saves again into the folder
        shutil.copytree(crash_dir, out / AFTER_KILL, symlinks=True)
    if _killed_in_save(_read_log(out / "crash" / LOG), args["kill_at"]):
        wait("resume", _fork(out, "resume", args))
    wait("planted", planted)


def _fork(out: Path, role: str, args: dict) -> int:
    folder = out / role
    folder.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:  # the child: its output to its own file, then its part of the test
        fd = os.open(folder / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2)
        worker(role, out, **args)
    except BaseException:  # noqa: BLE001 - reported in the child's output; the log says what it got to
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def plant(whole_dir, planted_dir, every: int, kill_at: int) -> dict:
    """A folder of the whole run's checkpoints before `kill_at`, the newest with one bit flipped in its first
    weight's bytes (listed, its recorded checksum no longer matches), the first half of step `kill_at`'s file under
    its final name (not listed: what a save in place leaves), and a stray temp file. Returns {file: what it is}."""
    whole_dir, planted_dir = Path(whole_dir), Path(planted_dir)
    shutil.rmtree(planted_dir, ignore_errors=True)
    planted_dir.mkdir(parents=True)
    entries = [e for e in json.loads((whole_dir / MANIFEST).read_text())["checkpoints"] if e["step"] < kill_at]
    truth = {}
    for e in entries:
        shutil.copyfile(whole_dir / e["file"], planted_dir / e["file"])
        truth[e["file"]] = "complete"
    (planted_dir / MANIFEST).write_text(json.dumps({"checkpoints": entries}, indent=1))
    newest = planted_dir / entries[-1]["file"]
    data = bytearray(newest.read_bytes())
    state = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    first = next(iter(state["model"].values())).numpy().tobytes()
    at = bytes(data).find(first)
    data[at if at >= 0 else len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    truth[newest.name] = "corrupted"
    full = (whole_dir / checkpoint_name(kill_at)).read_bytes()
    (planted_dir / checkpoint_name(kill_at)).write_bytes(full[:len(full) // 2])
    (planted_dir / f".{checkpoint_name(kill_at)}.tmp").write_bytes(full[:len(full) // 3])
    truth[checkpoint_name(kill_at)] = "partial"
    truth[f".{checkpoint_name(kill_at)}.tmp"] = "partial"
    return truth


# -- the verdict: from the files alone (the experiment and the grader) -------------------------------------------
def verdict(read) -> dict:
    """Everything the kill test shows, from the files it left: `read(relative path)` gives a file's bytes, or None
    when there is none (the experiment reads its folder; the grader the same folder in a working copy).

    save_problems: what is wrong with the student's save (the kill left a partial file under a checkpoint's name, a
    complete save not listed or listed with a wrong checksum, an operation missing or out of order); restore_problems:
    what is wrong with the planted restore (not the newest intact checkpoint, a state that is not the whole run's at
    that step, loaded bytes of a partial or corrupted file, losses or final state different from the whole run's);
    resume_problems: the same for the resume after the kill."""
    logs = {role: read_log((read(f"{role}/{LOG}") or b"").decode("utf-8", "replace")) for role in ROLES}
    start = next((e for e in logs["whole"] if e.get("type") == "start"), None)
    if start is None:
        raise ValueError("the whole run's log has no start event: the kill test did not run")
    every, kill_at, steps = int(start["every"]), int(start["kill_at"]), int(start["steps"])
    whole = _training(logs["whole"])
    out = {"steps": steps, "every": every, "kill_at": kill_at, "code": start.get("code", {}),
           "whole_losses": whole["losses"], "save_error": _error(logs["crash"], "save"),
           "restore_error": _error(logs["planted"], "restore")}
    out.update(_save_verdict(logs["crash"], read, every, kill_at))
    truth = {name: kind for name, kind in _planted_truth(read, every, kill_at).items()}
    out["planted"] = _resume_verdict(logs["planted"], whole, truth, expected=kill_at - 2 * every)
    out["restore_problems"] = out["planted"]["problems"]
    kill_truth = {name: ("complete" if name in out["after_kill"]["intact"] else "partial")
                  for name in out["after_kill"]["files"]}
    if logs["resume"]:
        out["resume"] = _resume_verdict(logs["resume"], whole, kill_truth, expected=kill_at - every)
        out["resume_problems"] = out["resume"]["problems"]
    else:
        out["resume"] = None
        why = f"the save raised {out['save_error']}" if out["save_error"] else \
            "the crash run was not killed in the middle of a save"
        out["resume_problems"] = [f"no resume ran: {why}"]
    out["save_ok"], out["restore_ok"] = not out["save_problems"], not out["restore_problems"]
    out["resume_ok"] = not out["resume_problems"]
    return out


def _error(log: list[dict], where: str) -> str | None:
    return next((e["error"] for e in log if e.get("type") == "error" and e.get("where") == where), None)


def _training(log: list[dict]) -> dict:
    return {"losses": {int(e["step"]): e["loss"] for e in log if e.get("type") == "step"},
            "states": {e["step"]: e["digest"] for e in log if e.get("type") == "state"}}


def _killed_in_save(log: list[dict], kill_at: int) -> bool:
    """The log shows the save of `kill_at` begun, never ended, and the process killed by SIGXFSZ."""
    begun = any(e.get("type") == "save_begin" and e.get("step") == kill_at for e in log)
    ended = any(e.get("type") == "save_end" and e.get("step") == kill_at for e in log)
    exit_ = next((e for e in log if e.get("type") == "exit"), {})
    return begun and not ended and exit_.get("signal") == "SIGXFSZ"


def _save_verdict(log: list[dict], read, every: int, kill_at: int) -> dict:
    problems = []
    error = _error(log, "save")
    if error:
        problems.append(f"the save raised {error}")
    elif not _killed_in_save(log, kill_at):
        exit_ = next((e for e in log if e.get("type") == "exit"), {})
        armed = next((e for e in log if e.get("type") == "armed"), {})
        problems.append(f"the save of step {kill_at} was not killed in the middle (the run exited with "
                        f"{exit_.get('signal') or exit_.get('returncode')}): none of its files reached "
                        f"{armed.get('bytes', '?')} bytes; does it save the model, the optimizer and the RNG?")
    # the folder as the kill left it
    manifest_bytes = read(f"{AFTER_KILL}/{MANIFEST}")
    entries, listed = [], {}
    try:
        entries = json.loads(manifest_bytes)["checkpoints"] if manifest_bytes is not None else []
        listed = {e["file"]: e for e in entries}
        assert all(isinstance(e["step"], int) and isinstance(e["checksum"], str) for e in entries)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        problems.append(f"after the kill, {MANIFEST} is not a valid manifest ({type(e).__name__}: {e}): a restart "
                        "cannot trust any checkpoint")
        entries, listed = [], {}
    files, intact = {}, []
    for step in range(every, kill_at + every, every):
        name = checkpoint_name(step)
        data = read(f"{AFTER_KILL}/{name}")
        if data is not None:
            files[name] = len(data)
        entry = listed.get(name)
        if data is not None and entry is None:
            problems.append(f"after the kill, {name} ({len(data)} bytes) lies under a checkpoint's name but is not "
                            "in the manifest: a partial file where a restart looking for the newest file finds it "
                            "(write it to a temporary name and rename it into place when complete)")
        elif entry is not None and data is None:
            problems.append(f"the manifest lists {name}, which is not there")
        elif entry is not None and crc32_of(data) != entry["checksum"]:
            problems.append(f"{name}'s bytes do not match the manifest's checksum {entry['checksum']} "
                            f"(they give {crc32_of(data)})")
        elif entry is not None:
            intact.append(name)
        if step < kill_at and entry is None and not error:
            problems.append(f"the save of step {step} returned, but the manifest does not list {name}")
    if manifest_bytes is None and not error:
        problems.append(f"after the kill there is no {MANIFEST}")
    # the order of each finished save's file operations (the log)
    order = {}
    for step, ops in _save_ops(log).items():
        order[step] = _order_problems(ops, checkpoint_name(step))
        problems += [f"save of step {step}: {p}" for p in order[step][:2]]
        if order[step]:
            break  # one save's mistakes say it; the next saves repeat them
    return {"save_problems": problems, "killed_in_save": _killed_in_save(log, kill_at),
            "after_kill": {"files": files, "listed": sorted(listed), "intact": intact},
            "save_ops": {str(k): v for k, v in _save_ops(log).items()}}


def _save_ops(log: list[dict]) -> dict[int, list[dict]]:
    """{step: the file operations of that save} for the saves that returned."""
    out, current, ops = {}, None, []
    for e in log:
        if e.get("type") == "save_begin":
            current, ops = e["step"], []
        elif e.get("type") == "op" and current is not None:
            ops.append(e)
        elif e.get("type") == "save_end" and e.get("step") == current:
            out[current] = ops
            current = None
    return out


def _order_problems(ops: list[dict], final: str) -> list[str]:
    """What a save's operations lack for a crash at any instant to leave the old state or the new one: the
    checkpoint and then the manifest each written to a temporary file in the folder, fsynced, renamed into place,
    and the folder fsynced after each rename."""
    def fsynced(path, lo, hi):
        return any(o["op"] == "fsync" and o.get("path") == path for o in ops[lo:hi])

    def rename_into(dst, after=-1):
        return next(((i, o) for i, o in enumerate(ops) if o["op"] == "rename" and o.get("dst") == dst and i > after),
                    (None, None))

    i, ck = rename_into(final)
    if ck is None:
        return [f"{final} was not renamed into place: written under its own name, a kill leaves it half-written"]
    problems = []
    if "/" in ck["src"] or ck["src"].startswith(".."):
        problems.append(f"{final} was renamed from {ck['src']}, outside the checkpoint folder: write the temporary "
                        "file beside it (a rename is atomic only within one file system)")
    if not fsynced(ck["src"], 0, i):
        problems.append(f"the temporary file {ck['src']} was not fsynced before its rename: after a power cut the "
                        "name could point at a file whose data never reached the disk")
    j, man = rename_into(MANIFEST, after=i)
    if man is None:
        problems.append(f"{MANIFEST} was not replaced by a rename after {final}'s: the manifest must be written like a "
                        "checkpoint (temporary file, fsync, rename) and only once the checkpoint is in place")
        return problems
    if not fsynced(".", i, j):
        problems.append(f"the folder was not fsynced between {final}'s rename and the manifest's: the rename itself "
                        "could be lost in a power cut while the manifest's entry survives")
    if not fsynced(man["src"], i, j):
        problems.append(f"the manifest's temporary file {man['src']} was not fsynced before its rename")
    if not fsynced(".", j, len(ops)):
        problems.append("the folder was not fsynced after the manifest's rename")
    return problems


def _planted_truth(read, every: int, kill_at: int) -> dict:
    """{file: complete | corrupted | partial} of the planted folder, from the files themselves and the manifest."""
    entries = json.loads(read(f"planted/{CKPT}/{MANIFEST}") or b'{"checkpoints": []}')["checkpoints"]
    truth = {}
    for e in entries:
        data = read(f"planted/{CKPT}/{e['file']}")
        truth[e["file"]] = "complete" if data is not None and crc32_of(data) == e["checksum"] else "corrupted"
    truth.setdefault(checkpoint_name(kill_at), "partial")
    return truth


def _resume_verdict(log: list[dict], whole: dict, truth: dict, expected: int) -> dict:
    """Did the restore load the newest intact checkpoint (`expected`), exactly as the whole run had it, and did the
    run that followed compute the whole run's numbers?"""
    problems = []
    error = _error(log, "restore") or _error(log, "train")
    rest = next((e for e in log if e.get("type") == "restore"), None)
    loaded = rest.get("loaded", []) if rest else []
    bad = [f"{x['source']} ({truth.get(x['source'], 'not a checkpoint the run saved')})" for x in loaded
           if truth.get(x["source"]) != "complete"]
    if bad:
        problems.append("the restore loaded " + ", ".join(bad) + ": only a checkpoint the manifest lists with a "
                        "matching checksum may be loaded")
    if error:
        problems.append(f"the restore raised {error}")
    elif rest is None:
        problems.append("the restore did not return")
    else:
        got = rest["step"]
        if got != expected:
            problems.append(f"the restore resumed from step {got}; the newest intact checkpoint is step {expected}")
        elif rest["digest"] != whole["states"].get(expected):
            problems.append(f"the state restored at step {expected} is not the one the run had at that step (model, "
                            "optimizer momentum and RNG state must all come back)")
    resumed = _training(log)
    start = rest["step"] if rest and isinstance(rest.get("step"), int) else None
    tail = {s: v for s, v in whole["losses"].items() if start is not None and s > start}
    differ = sorted(s for s in tail if resumed["losses"].get(s) != tail[s])
    if start is not None and not error:
        if differ:
            problems.append(f"the resumed run's losses differ from the uninterrupted run's from step {differ[0]} on "
                            f"({resumed['losses'].get(differ[0])!r} against {tail[differ[0]]!r})")
        elif resumed["states"].get("final") != whole["states"].get("final"):
            problems.append("the resumed run ends with a different state than the uninterrupted run")
    return {"restored_step": start, "expected_step": expected, "loaded": loaded, "losses": resumed["losses"],
            "differ_from": differ[0] if differ else None, "problems": problems,
            "equal": start is not None and not differ and not error
            and resumed["states"].get("final") == whole["states"].get("final")}


def read_log(text: str) -> list[dict]:
    """The events of a log.jsonl text (a line that is not a JSON object is skipped: the last one a kill cut)."""
    return json_lines(text)


def _read_log(path: Path) -> list[dict]:
    return read_log(path.read_text()) if path.exists() else []


def reader_beneath(workdir, run_dir):
    """`read(relative path)` for `verdict`, reading the kill test's folder in a working copy as data that may be
    hostile (no symbolic link followed, at most MAX_FILE_BYTES a file); None for a file that is not there."""
    rel = os.path.relpath(str(run_dir), str(workdir)) if os.path.isabs(str(run_dir)) else str(run_dir)

    def read(name):
        try:
            return read_beneath(workdir, Path(os.path.normpath(rel), name).as_posix(), MAX_FILE_BYTES)
        except Exception as e:  # noqa: BLE001 - missing, a link, too big: the student's files
            if "No such file" in str(e):
                return None
            raise
    return read


# -- the worker process ------------------------------------------------------------------------------------------
class _Log:
    """One JSON line per event, each its own write on an O_APPEND file (a kill cuts at most the last line)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, **event) -> None:
        os.write(self.fd, (json.dumps(event) + "\n").encode())


class _Tracer:
    """Logs the file operations under the checkpoint folder while `on`: open (for writing), rename/replace, remove
    (an audit hook: Python raises these events however the file is named), fsync/fdatasync (wrapped)."""

    def __init__(self, folder: Path, log: _Log):
        self.folder, self.log, self.on = str(folder.resolve()), log, False
        sys.addaudithook(self._audit)
        for name in ("fsync", "fdatasync"):
            original = getattr(os, name)
            setattr(os, name, self._wrap_fsync(original))

    def rel(self, path) -> str | None:
        try:
            p = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return None
        return os.path.relpath(p, self.folder)

    def _audit(self, event, args) -> None:
        if not self.on:
            return
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2] or 0
            writing = (mode is not None and any(c in mode for c in "wax+")) or bool(flags & (os.O_WRONLY | os.O_RDWR))
            if writing and (r := self.rel(args[0])) is not None:
                self.log(type="op", op="open", path=r)
        elif event == "os.rename":
            self.log(type="op", op="rename", src=self.rel(args[0]), dst=self.rel(args[1]))
        elif event == "os.remove":
            self.log(type="op", op="remove", path=self.rel(args[0]))

    def _wrap_fsync(self, original):
        def fsync(fd):
            if self.on:
                n = fd if isinstance(fd, int) else fd.fileno()
                try:
                    target = self.rel(os.readlink(f"/proc/self/fd/{n}"))
                except OSError:
                    target = None
                self.log(type="op", op="fsync", path=target)
            return original(fd)
        return fsync


def _digest(model, optimizer) -> str:
    """SHA-256 of the whole training state: every weight, the optimizer's state and the CPU RNG."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for index, st in sorted(optimizer.state_dict()["state"].items()):
        for key, t in sorted(st.items()):
            h.update(f"{index}.{key}".encode())
            h.update(t.contiguous().numpy().tobytes() if torch.is_tensor(t) else repr(t).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def _watch_loads(log_loaded: list, known: dict):
    """Wrap torch.load: each call notes the crc32 of the bytes it was given (a path or a buffer), matched to the
    files of the folder (`known`: {crc32: file name}), before loading them."""
    original = torch.load

    def load(f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            with builtins.open(f, "rb") as fh:
                data = fh.read()
            name = os.path.basename(os.fsdecode(f))
        elif hasattr(f, "getvalue"):
            data, name = f.getvalue(), None
        else:
            pos = f.tell()
            data = f.read()
            f.seek(pos)
            name = os.path.basename(str(getattr(f, "name", ""))) or None
        crc = crc32_of(data)
        log_loaded.append({"source": known.get(crc) or name or "bytes of no file in the folder", "checksum": crc,
                           "bytes": len(data)})
        return original(f, *args, **kwargs)
    torch.load = load


def _model(width: int):
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))


def worker(role: str, out: Path, module: str, steps: int, every: int, kill_at: int, width: int, code: dict) -> None:
    """One process of the kill test (see the module's docstring)."""
    torch.set_num_threads(1)
    folder = out / role
    log = _Log(folder / LOG)
    directory = (out / "crash" / CKPT) if role in ("crash", "resume") else folder / CKPT
    directory.mkdir(parents=True, exist_ok=True)
    tracer = _Tracer(directory, log)
    log(type="start", role=role, steps=steps, every=every, kill_at=kill_at, width=width, code=code, pid=os.getpid())
    save = restore = None
    if role != "whole":
        sys.path.insert(0, str(out / "code"))
        mine = __import__(module)
        save, restore = mine.save, mine.restore
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 32, generator=g)
    y = (x[:, :10].argmax(1) + (x[:, 10] > 0).long()) % 10
    torch.manual_seed(0)
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if role == "planted":
        plant(out / "whole" / CKPT, directory, every=every, kill_at=kill_at)
    if role in ("resume", "planted"):
        loaded = []
        known = {}
        for p in directory.iterdir():
            if p.is_file() and p.name != MANIFEST:
                known.setdefault(crc32_of(p.read_bytes()), p.name)
        _watch_loads(loaded, known)
        t0 = time.perf_counter()
        try:
            start = restore(str(directory), model, opt)
        except Exception as e:  # noqa: BLE001 - the student's code: its error is the result
            log(type="restore", step=None, loaded=loaded, seconds=time.perf_counter() - t0)
            log(type="error", where="restore", error=_error_text(e, module, "restore"))
            return
        if isinstance(start, bool) or not isinstance(start, int):
            log(type="error", where="restore", error=f"it returned {start!r}, not the step (an int)")
            return
        log(type="restore", step=start, digest=_digest(model, opt), loaded=loaded, seconds=time.perf_counter() - t0)
    saving = role in ("crash", "resume")
    for step in range(start + 1, steps + 1):
        idx = torch.randint(0, len(x), (32,))
        model.train()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log(type="step", step=step, loss=loss.item())
        if step % every or step == steps:
            continue
        if role == "whole":
            log(type="state", step=step, digest=_digest(model, opt))
            save_checkpoint(directory, step, model, opt, keep_last=10_000)
        elif saving:
            if role == "crash" and step == kill_at:
                _arm(log, model, opt)
            log(type="save_begin", step=step)
            tracer.on = True
            t0 = time.perf_counter()
            try:
                save(str(directory), step, model, opt)
            except Exception as e:  # noqa: BLE001
                tracer.on = False
                log(type="error", where="save", error=_error_text(e, module, "save"))
                saving = False
                continue
            tracer.on = False
            log(type="save_end", step=step, seconds=time.perf_counter() - t0)
            resource.setrlimit(resource.RLIMIT_FSIZE, _FSIZE)  # disarmed (a save that wrote too little)
    log(type="state", step="final", digest=_digest(model, opt))
    log(type="end", step=steps)


_FSIZE = resource.getrlimit(resource.RLIMIT_FSIZE)


def _arm(log: _Log, model, opt) -> None:
    """From now on, the kernel kills this process the moment it writes past a quarter of a checkpoint's size in any
    file (SIGXFSZ, whose default action Python had set aside)."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, buf)
    limit = buf.getbuffer().nbytes // 4
    log(type="armed", bytes=limit, checkpoint_bytes=buf.getbuffer().nbytes)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, _FSIZE[1]))


def _error_text(e: BaseException, module: str, name: str) -> str:
    if isinstance(e, NotImplementedError):
        return (f"NotImplementedError: {name} in {module}.py is not written yet: write its solution, run that cell "
                "(it writes the file), then the kill test again")
    return f"{type(e).__name__}: {e}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Lab 06's kill test: its processes, forked from this one")
    p.add_argument("--out", required=True)
    p.add_argument("--args", required=True)
    a = p.parse_args(argv)
    serve(Path(a.out), json.loads(a.args))


if __name__ == "__main__":
    main()


__all__ = ["kill_and_resume", "verdict", "plant", "reader_beneath", "read_log", "checkpoint_name", "crc32_of",
           "LOG", "AFTER_KILL"]
