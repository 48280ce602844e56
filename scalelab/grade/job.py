"""One submission's job folder and its sandboxed run: what the grader does around `scalelab.grade.runner`.

    job/                 0700, owned by the run's throwaway uid; its parent is root's 0711 batch folder
      work/              the lab as a student has it (released versions, or the student's own from a submitted
                         folder) + the submission as lab.ipynb
      home/ tmp/         HOME and TMPDIR of the run
      out/lab.ipynb      the executed notebook (untrusted: read back with `untrusted`)
      job.json           what the runner must do
    job.outcome.json     beside the job folder, in the batch folder the run cannot write to: what the runner
                         (root, outside the run's namespaces) says happened
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from ..course.lab import CHECKS, NOTEBOOK, SETTINGS, GradingError, Lab, cell_source, find_labs, student_files
from ..course.release import student_file
from ..paths import checkout_root, labs_dir, read_beneath, scheduler_paths
from ..run.nonce import NONCE_VAR
from .reap import cleanup
from .sandbox import SandboxPlan, blocking_ancestor, needed_paths, runner_needed_paths
from .untrusted import UntrustedFileError, load_json_beneath

MNT_DETACH = 2

RUNNER_GRACE_S = 60.0  # kernel start-up and papermill's own clean-up on top of the notebook's total limit
MAX_SUBMISSION_BYTES = 32 * 2**20
# The runner starts as root in the job's work folder, which holds student files (the notebook, the lab's modules):
# its import path must not begin with that folder, as `python -m` would make it, or a student's module could
# shadow one the runner imports while still root.
RUNNER_MAIN = "import sys; del sys.path[0]; from scalelab.grade.runner import main; sys.exit(main(sys.argv[1:]))"
OUTPUT_LIMIT = 200_000  # characters a cell may print while it runs (the rest is cut with a note; records never)
# The environment a submission sees: nothing else of the grader's (tokens, passwords) reaches student code.
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "VIRTUAL_ENV", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def copy_submission(path: Path, work: Path) -> str | None:
    """Put the submission in the working copy as lab.ipynb; returns why it cannot be used, or None.

    The submission may sit in a student's own folder (an instructor grading homes directly, as root): a symbolic
    link anywhere in its path is refused (a student's lab folder linked to a classmate's would hand in the
    classmate's work), and the file is read without following a link planted after that check."""
    work.mkdir(parents=True)
    if path.is_symlink():
        return f"{path.name} is a symbolic link, not a notebook file"
    if not path.is_file():
        return f"{path} does not exist (or is not a file)"
    if os.path.realpath(path) != os.path.abspath(path):
        return (f"{path} is reached through a symbolic link ({os.path.realpath(path)}): grade the collected copy "
                "(scalelab course collect) or the real path")
    if path.stat().st_size > MAX_SUBMISSION_BYTES:
        return (f"{path.name} is {path.stat().st_size / 2**20:.1f} MiB, over the "
                f"{MAX_SUBMISSION_BYTES // 2**20} MiB a submission may have: clear the outputs and submit again")
    try:
        data = read_beneath(path.parent, path.name, MAX_SUBMISSION_BYTES, single_link=True)
    except UntrustedFileError as e:
        return f"{path.name} cannot be read safely: {e}"
    (work / NOTEBOOK).write_bytes(data)
    return None


INJECTED_TAG = "injected-parameters"
PYTHON_KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def guard_parameters(notebook: Path, reference: Path, parameters: dict) -> list[str]:
    """Make the grader's parameters win in the submitted `notebook` (rewritten in place); notes for the student.

    - cells tagged `injected-parameters` are removed: papermill would replace the *first* of them with the
      grader's values, so one placed above the parameters cell let the student's values run after them;
    - a kernelspec or language other than Python is replaced: papermill writes parameters in the notebook's
      language, and the run uses the course's Python kernel in any case;
    - a parameters cell that differs from the lab's, and later cells that assign a parameter the grader sets,
      are reported (the grader's values are injected right after the parameters cell).
    A file that is not a notebook is left alone: running it reports that.
    """
    try:
        nb = json.loads(notebook.read_text(encoding="utf-8"))
        cells = nb["cells"]
        if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
            return []
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return []
    notes = []
    injected = [i for i, c in enumerate(cells) if INJECTED_TAG in _tags(c)]
    if injected:
        nb["cells"] = cells = [c for c in cells if INJECTED_TAG not in _tags(c)]
        notes.append(f"cell(s) {injected} were tagged '{INJECTED_TAG}' and were removed: the grader sets the "
                     "parameters itself, right after the cell tagged 'parameters'")
    meta = nb.get("metadata") if isinstance(nb.get("metadata"), dict) else {}
    spec = meta.get("kernelspec") if isinstance(meta.get("kernelspec"), dict) else {}
    lang = (meta.get("language_info") or {}).get("name") if isinstance(meta.get("language_info"), dict) else None
    if spec.get("language", "python") != "python" or lang not in (None, "python"):
        notes.append(f"your notebook asked for the kernel {str(spec.get('name'))[:60]!r} (language "
                     f"{str(spec.get('language') or lang)[:30]!r}): it was graded on the course's Python kernel")
    meta["kernelspec"] = dict(PYTHON_KERNELSPEC)
    meta["language_info"] = {"name": "python"}
    nb["metadata"] = meta
    mine = next((i for i, c in enumerate(cells) if "parameters" in _tags(c)), None)
    theirs = _parameters_source(reference)
    if mine is not None and theirs is not None and _squash(cell_source(cells[mine])) != _squash(theirs):
        notes.append("your parameters cell differs from the lab's: the grader's values of "
                     f"{sorted(parameters)} were set right after it; the rest of your changes there were kept")
    if mine is not None and parameters:
        for i, c in enumerate(cells[mine + 1:], start=mine + 1):
            hit = sorted(_assigned(cell_source(c)) & set(parameters)) if c.get("cell_type") == "code" else []
            if hit:
                notes.append(f"cell {i} assigns {hit}, which the grader sets as parameters: the values the "
                             "grader chose were overwritten there")
    # A lone surrogate (a "\udc80" escape is valid JSON) cannot be written as UTF-8: papermill would fail saving the
    # executed notebook before the first cell, the grader writing this file. Replaced, as a decoder would ("?").
    notebook.write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8", errors="replace")
    return notes[:10]


def _tags(cell: dict) -> list:
    meta = cell.get("metadata")
    tags = meta.get("tags", []) if isinstance(meta, dict) else []
    return tags if isinstance(tags, list) else []


def _squash(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines() if line.strip())


def _parameters_source(reference: Path) -> str | None:
    try:
        cells = json.loads(reference.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError):
        return None
    return next((cell_source(c) for c in cells if "parameters" in _tags(c)), None)


def _assigned(code: str) -> set[str]:
    """Names a cell assigns at its top level (assignments, augmented and annotated ones, for targets)."""
    import ast
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For)) else [])
        for t in targets:
            names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def working_copy(lab: Lab, job: Path, own: Path | None = None) -> list[str]:
    """The lab as a student has it (solutions replaced, no hidden checks) around the submission; HOME, TMPDIR.

    With `own` (a submitted folder), the student's versions of the lab's other files (e.g. a module with an
    exercise) are used instead, except checks.py and lab.yaml, which always come from the lab. Returns the
    files taken from the student."""
    work, taken = job / "work", []
    for rel in student_files(lab.path):
        if rel == Path(NOTEBOOK):
            continue
        target = work / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        mine = _own_file(own, rel) if own is not None and rel.name not in (CHECKS, SETTINGS) else None
        if mine is not None:
            target.write_bytes(mine)
            taken.append(rel.as_posix())
        else:
            target.write_bytes(student_file(lab.path, rel)[0])
    for name in ("home", "tmp", "out"):
        (job / name).mkdir()
    return taken


def _own_file(own: Path, rel: Path) -> bytes | None:
    """The bytes of the student's regular file `rel` inside `own`, or None: read without following any link below
    `own` (checked and read in one go, so a link swapped in between is not followed either), nor a file with other
    hard links (a link to a file elsewhere)."""
    try:
        return read_beneath(own, rel, MAX_SUBMISSION_BYTES, single_link=True)
    except (UntrustedFileError, OSError):
        return None


def runner_env() -> dict[str, str]:
    """The grader's environment as far as a submission's run may see it (ENV_KEEP)."""
    return {k: os.environ[k] for k in ENV_KEEP if k in os.environ}


def runs_need(base: Path) -> list[str]:
    """What every run must be able to read, from the runs' own view (`runner_needed_paths`)."""
    return runner_needed_paths({**runner_env(), "PYTHONDONTWRITEBYTECODE": "1"}, base)


def run_job(job: Path, plan: SandboxPlan, parameters: dict, cell_timeout: float, total: float,
            log_path: Path, output_limit: int | None = OUTPUT_LIMIT, continue_on_error: bool = True,
            nonce: str | None = None, reverify: list[dict] | None = None) -> dict:
    """Start the sandboxed runner on the job and wait for it (or its limit); returns the raw outcome (untrusted).

    nonce: the grading's nonce, in the run's environment (run/nonce.py). reverify: instead of the notebook, the
    grader's re-runs of some of its runs (grade/reverify.py), inside `total` seconds."""
    outcome_path = outcome_file(job)
    spec = {"notebook": str(job / "work" / NOTEBOOK), "output": str(job / "out" / NOTEBOOK), "cwd": str(job / "work"),
            "parameters": parameters, "cell_timeout": cell_timeout,
            "total_timeout": total, "sandbox": plan.to_dict(), "outcome": str(outcome_path),
            "output_limit": output_limit, "continue_on_error": continue_on_error, "nonce": nonce,
            "reverify": reverify}
    job_file = job / "job.json"
    job_file.write_text(json.dumps(spec))
    if plan.uid is not None:
        chown_tree(job, plan.uid, plan.gid)
    job.chmod(0o700)
    env = runner_env()
    env.update(HOME=str(job / "home"), TMPDIR=str(job / "tmp"), USER="student", LOGNAME="student",
               PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="Agg")
    if nonce:
        env[NONCE_VAR] = nonce
    with open(log_path, "wb") as log:
        note_job(job, plan)  # before the start: a grader dying in between leaves a plan to end, not a run unknown
        proc = subprocess.Popen([sys.executable, "-c", RUNNER_MAIN, str(job_file)], cwd=job / "work",
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        note_job(job, plan, proc.pid)
        try:
            proc.wait(total + RUNNER_GRACE_S)
        except subprocess.TimeoutExpired:
            cleanup(plan, proc.pid)
            proc.wait()
            return {"status": "timeout", "message": f"the run passed the grader's hard limit of "
                                                    f"{total + RUNNER_GRACE_S:g} s and was killed"}
        cleanup(plan, proc.pid)
    cap_file(log_path)
    try:
        outcome = load_json_beneath(outcome_path.parent, outcome_path.name, 2**20)
    except (UntrustedFileError, ValueError, RecursionError) as e:
        return {"status": "grader_error", "message": f"the runner left no readable outcome ({e}; runner exit "
                                                     f"{proc.returncode}); see its log: {log_path.name}"}
    finally:
        outcome_path.unlink(missing_ok=True)
    return outcome if isinstance(outcome, dict) else {"status": "grader_error", "message": "outcome is not a dict"}


def outcome_file(job: Path) -> Path:
    """Where the runner writes the outcome: beside the job folder, in the batch folder only root may write to."""
    return job.parent / f"{job.name}.outcome.json"


def cap_file(path: Path, limit: int = 256 * 1024) -> None:
    """Keep only the end of a long runner log."""
    if path.stat().st_size > limit:
        with open(path, "rb") as f:
            f.seek(-limit, os.SEEK_END)
            tail = f.read()
        path.write_bytes(b"[... start cut by the grader ...]\n" + tail)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give a job folder to the run's uid (never following a link)."""
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, gid)
        for name in filenames:
            os.lchown(os.path.join(dirpath, name), uid, gid)


def cap_job_folder(job: Path, size_mb: int | None) -> bool:
    """As root: mount a tmpfs of `size_mb` on the (still empty) job folder, so a run that writes without end fills
    its own folder (ENOSPC) and not the grading host's disk, which RLIMIT_FSIZE (one file) does not prevent. The
    tmpfs lives in memory, charged to the run's cgroup where there is one. Returns whether it was mounted."""
    if size_mb is None or os.geteuid() != 0:
        return False
    from .confine import MS_NODEV, MS_NOSUID, _call
    _call("mount", b"tmpfs", os.fsencode(job), b"tmpfs", MS_NOSUID | MS_NODEV, f"size={int(size_mb)}m,mode=0700".encode())
    return True


def release_job_folder(job: Path, keep: bool = False) -> None:
    """Unmount a capped job folder (detached: the run's processes are gone by now); its contents go with it, or with
    `keep` (--keep-workdirs) are first copied to the disk beneath, at the same path (`keep_tree`)."""
    from .confine import _call
    kept = None
    if keep:
        kept = Path(tempfile.mkdtemp(prefix=f".{job.name}-", dir=job.parent))
        try:
            keep_tree(job, kept)
        except (OSError, RecursionError):  # kept as far as it went: the unmount must happen whatever the tree
            pass
    _call("umount2", os.fsencode(job), MNT_DETACH)
    if kept is not None:
        for child in kept.iterdir():
            child.rename(job / child.name)
        kept.rmdir()


def keep_tree(src: Path, dest: Path) -> None:
    """Copy a run's folder (the student's files: hostile) without following any link: folders and regular files
    are copied with their owners and permission bits (never set-user or set-group-ID: the disk may not be nosuid as
    the tmpfs was), symbolic links as links, anything else (FIFOs, sockets) left out."""
    for entry in os.scandir(src):
        st = entry.stat(follow_symlinks=False)
        target = dest / entry.name
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(entry.path), target)
        elif stat.S_ISDIR(st.st_mode):
            target.mkdir()
            keep_tree(Path(entry.path), target)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f, open(target, "wb") as out:
                shutil.copyfileobj(f, out)
        else:
            continue
        os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(target, stat.S_IMODE(st.st_mode) & 0o777)


JOB_NAME_CHARS = 12
"""A job folder is named after the student's first JOB_NAME_CHARS characters (and a random part)."""
MAX_BASE_CHARS = 48
"""Longest path of a batch's folder of job folders. A run's TMPDIR is <base>/<job>/tmp, and Python's
multiprocessing binds Unix sockets there (pymp-XXXXXXXX/listener-XXXXXXXX: a DataLoader with workers sending a
tensor does): a socket's path must stay under 108 bytes, or the worker fails and the cell hangs to its time limit."""


def job_base(workdir: str | None, sandbox: bool, keep: bool = False) -> Path:
    """A folder for this batch's job folders: enterable (0711) so each throwaway uid reaches its own job; marked as
    this grader's (BATCH_MARKER), so a grader started after this one died cleans it up (`reap_crashed_batches`)."""
    where = Path(workdir or tempfile.gettempdir()).resolve()
    longest = len(str(where / "scalelab-grade-XXXXXXXX"))
    if longest > MAX_BASE_CHARS:
        raise GradingError(f"the job folders would be made in {where} ({longest} characters with the batch's "
                           f"folder): runs bind Unix sockets in their temporary folders there, whose paths must stay "
                           f"under 108 bytes; pass a shorter --workdir (at most {MAX_BASE_CHARS - 24} characters, "
                           "e.g. /tmp)")
    base = Path(tempfile.mkdtemp(prefix=BATCH_PREFIX, dir=workdir))
    base.chmod(0o711)
    _write_private(base, BATCH_MARKER, {**_this_process(), "keep": keep})
    if os.geteuid() == 0 and sandbox and blocking_ancestor(str(base)):
        shutil.rmtree(base)
        raise GradingError(f"job folders would be made in {base.parent}, inside {blocking_ancestor(str(base))} "
                           "which other users cannot enter; pass --workdir /tmp (or another such folder)")
    return base


BATCH_PREFIX = "scalelab-grade-"
BATCH_MARKER = "batch.grader.json"
"""In each batch folder, 0600 and the grader's: which process made the batch (host, boot, pid and that pid's start
time) and whether it keeps its job folders. A job folder's name always ends in '-' and a random part, so it never
takes this name. A grader that finishes with --keep-workdirs removes it (the kept folders are the instructor's)."""
JOB_RECORD = ".grader.json"
"""Beside each job folder, in the batch folder the runs cannot write to: `<job>.grader.json`, the run's sandbox
plan (its throwaway uid and cgroup) and the runner's pid and start time, for a later grader to end what is left."""


def _this_process(pid: int | None = None) -> dict:
    """What identifies a process on this machine across pid reuse: host, boot, pid and its start time."""
    import psutil
    pid = os.getpid() if pid is None else pid
    try:
        start = psutil.Process(pid).create_time()
    except psutil.Error:
        start = None
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "start": start}


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _same_process(who: dict) -> bool | None:
    """Whether the process `who` (from `_this_process`) still runs: True, False, or None when this machine cannot
    tell (another host's: a shared workdir; a record without a start time). A zombie has ended; a pid now held by a
    process started later is another process."""
    import psutil
    if not isinstance(who, dict) or who.get("host") != socket.gethostname():
        return None
    if who.get("boot_id") != _boot_id():
        return False  # the machine restarted since: every process of that batch is gone
    pid, start = who.get("pid"), who.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(start, (int, float)):
        return None
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - start) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _write_private(folder: Path, name: str, data: dict) -> None:
    """Write `folder`/`name` as JSON, 0600, never through a link (the folder is the grader's own)."""
    dfd = _dir_fd(folder)
    try:
        tmp = f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        os.close(dfd)


def _dir_fd(folder: Path) -> int:
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def note_job(job: Path, plan: SandboxPlan, runner_pid: int | None = None) -> None:
    """Record the job's sandbox plan (and, once started, its runner) beside it for `reap_crashed_batches`."""
    _write_private(job.parent, job.name + JOB_RECORD,
                   {"plan": plan.to_dict(), "runner": _this_process(runner_pid) if runner_pid else None})


def finish_batch(base: Path, keep: bool) -> None:
    """The batch ended normally: its folder goes, or with `keep` only its marker (the job folders are kept)."""
    if keep:
        (base / BATCH_MARKER).unlink(missing_ok=True)
    else:
        shutil.rmtree(base, ignore_errors=True)


def _own_json(folder: Path, name: str) -> dict | None:
    """A JSON object the grader wrote in its own folder: a regular 0600 file of this uid with one link, read
    without following any link; None otherwise."""
    try:
        dfd = _dir_fd(folder)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_mode & 0o077:
            return None
        data = load_json_beneath(folder, name, 2**20)
    except (OSError, UntrustedFileError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def reap_crashed_batches(workdir: str | None) -> list[Path]:
    """At a grader's start: end, unmount and remove what graders that died mid-batch left in `workdir`.

    Only batch folders of this uid holding a marker a grader wrote (BATCH_MARKER), whose process is gone, are
    touched: a live grader's batch (its pid still running with the same start time), another host's (a shared
    workdir) and a folder without a marker stay as they are. Per job the run's leftovers are ended first (the
    runner, if still the one started; every process of its throwaway uid; its cgroup: `reap.cleanup`), then every
    mount under the batch is detached (the capped job folders, deepest first) and the batch folder removed; a
    batch graded with --keep-workdirs keeps its job folders, copied off their tmpfs as a finished one would.
    Returns the batch folders cleaned up."""
    where = Path(workdir or tempfile.gettempdir())
    try:
        entries = [e for e in os.scandir(where) if e.name.startswith(BATCH_PREFIX)]
    except OSError:
        return []
    done = []
    for entry in entries:
        base = Path(entry.path)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        marker = _own_json(base, BATCH_MARKER)
        if marker is None or _same_process(marker) is not False:
            continue
        _reap_batch(base, keep=marker.get("keep") is True)
        done.append(base)
    return done


def _reap_batch(base: Path, keep: bool) -> None:
    cancel_slurm_jobs(base)  # grade --slurm: the dead grader's jobs, queued or running, end with its batch
    for name in sorted(os.listdir(base)):
        if not name.endswith(JOB_RECORD) or name == BATCH_MARKER or name.startswith("."):
            continue
        record = _own_json(base, name)
        if record is None:
            continue
        try:
            plan = SandboxPlan.from_dict(record["plan"])
        except (KeyError, TypeError, ValueError):
            continue
        runner = record.get("runner")
        try:
            cleanup(plan, runner["pid"] if _same_process(runner) is True else None)
        except Exception:  # noqa: BLE001 - one job's leftovers never stop the clean-up of the rest
            pass
    for point in sorted(_mounts_below(base), key=lambda p: -len(Path(p).parts)):
        job = Path(point)
        try:
            if keep and job.parent == base:
                release_job_folder(job, keep=True)
            else:
                from .confine import _call
                _call("umount2", os.fsencode(job), MNT_DETACH)
        except OSError:
            pass
    if keep:
        finish_batch(base, keep=True)
    else:
        shutil.rmtree(base, ignore_errors=True)


SLURM_JOB = ".slurm-job.json"
"""Beside a job folder graded with --slurm, while its Slurm job may run: `<job>.slurm-job.json`, the job's id."""


def cancel_slurm_jobs(base: Path) -> list[str]:
    """scancel the Slurm jobs a batch folder records (`SLURM_JOB`, written by grade/slurm_grading.py); their ids."""
    ids = []
    for name in sorted(os.listdir(base)):
        record = _own_json(base, name) if name.endswith(SLURM_JOB) else None
        job = record.get("job") if record else None
        if isinstance(job, str) and job.isdigit():
            from ..cluster.slurm import slurm_command, slurm_env
            try:
                slurm_command(["scancel", job], slurm_env())
                ids.append(job)
            except Exception:  # noqa: BLE001 - Slurm gone too: the job ends at its own time limit
                pass
    return ids


def _mounts_below(folder: Path) -> list[str]:
    """Mount points strictly below `folder` in this mount namespace (/proc/self/mountinfo, octal escapes undone)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    prefix = str(folder).rstrip("/") + "/"
    points = []
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point.startswith(prefix):
            points.append(point)
    return points


def hidden_paths(lab: Lab, submissions: list[Path], out: Path, base: Path, extra: tuple[str, ...] = (),
                 needed: list[str] | None = None) -> tuple[list[str], list[str]]:
    """What a submission must not see, as (hide, cover).

    hide: the reference lab and its siblings, other submissions, the grades, what `extra` names. cover: the
    checkouts the lab and the scalelab packages (the grader's and the runs', `needed`) live in — shown to the run
    as empty folders but for what it needs inside them (`needed`), so no other copy of the labs in them is seen.
    A path the runs need (or the job folders' `base`) is never hidden; a folder holding one is covered instead.
    In a fresh root (as root) none of these exist anyway: `hide` is what the run checks is gone once confined, and
    `cover` matters only to the deny-list (without root).
    """
    needed = [Path(p) for p in (needed if needed is not None else needed_paths())]
    cands = {lab.path, out, *[Path(p).resolve() for p in extra]}
    cands.update(find_labs(lab.path.parent))
    cands.update(find_labs(labs_dir()))
    cands.update(p.resolve() for p in scheduler_paths())  # no munge socket, no Slurm: a run submits nothing
    # The checkouts: the lab's, the grader's and the runs' (of their package folders, not of the interpreter's).
    roots = {git_root(lab.path), checkout_root(), *(checkout_of(p) for p in needed if (p / "__init__.py").exists())}
    checkouts = {r for r in roots if r is not None and ((r / ".git").exists() or (r / "pyproject.toml").exists())
                 and not any(k == r or k in r.parents for k in needed)}
    for root in checkouts:
        if (root / ".git").exists():
            cands.add(root / ".git")
    hide, cover = set(), set()
    for path in submissions:
        parent = path.resolve().parent
        target = parent.parent if path.name == NOTEBOOK else parent
        cands.add(target)
        hide.add(path.resolve())  # used when its folder cannot be covered whole
        cands.update(_sibling_folders(target))  # submissions of other labs collected beside this lab's
    base = base.resolve()
    for cand in [*cands, *checkouts]:
        cand = Path(cand).resolve()
        if cand == base or cand in base.parents or any(cand == k for k in needed):
            continue  # the job folders and what the runs need stay visible
        (cover if any(cand in k.parents for k in needed) else hide).add(cand)
    return sorted(str(p) for p in hide if os.path.lexists(p)), sorted(str(p) for p in cover)


MAX_SIBLINGS = 200


def _sibling_folders(folder: Path) -> list[Path]:
    """The folders beside `folder` (e.g. collected/02_data_parallel beside collected/01_single_device); none when
    `folder` sits in a top-level or temporary folder, where its neighbours are not the course's."""
    parent = folder.parent
    if len(parent.parts) < 3 or str(parent) in ("/tmp", "/var/tmp", "/dev/shm", "/home"):
        return []
    try:
        found = [p for p in parent.iterdir() if p.is_dir() and not p.is_symlink() and p != folder]
    except OSError:
        return []
    return sorted(found)[:MAX_SIBLINGS]


def checkout_of(package: Path) -> Path | None:
    """The source tree a package folder belongs to: its git checkout, or its parent when that has pyproject.toml."""
    return git_root(package) or (package.parent if (package.parent / "pyproject.toml").exists() else None)


def git_root(path: Path) -> Path | None:
    """The checkout `path` lies in (the folder holding .git), or None."""
    for cand in [path, *path.parents]:
        if (cand / ".git").exists():
            return cand
    return None
