"""`scalelab grade` and `scalelab labs release`: thin commands over `grader.grade` and `release.release_labs`.

    scalelab grade labs/01_ddp subs/*.ipynb -j 2 --out build/grades/01_ddp
    scalelab grade labs/01_ddp subs/*.ipynb -j 8 --slurm --partition grading   # each submission a Slurm job
    scalelab labs release                      # every lab into build/student/labs/ (the hub hands these out)
    scalelab labs release 01_ddp --out /srv/course/labs
"""
from __future__ import annotations

import json
import subprocess
import sys

from ..course.lab import GradingError
from ..paths import student_labs_dir


def add_cli(subparsers) -> None:
    """Add `grade` and `labs` (with `release`) to the `scalelab` command."""
    g = subparsers.add_parser("grade", help="grade submitted notebooks of a lab (sandboxed, hidden checks)",
                              description="Execute each submission with papermill in its own confined process and "
                                          "working copy, run the lab's public and hidden checks on its records, and "
                                          "write JSON results, HTML feedback and a CSV gradebook.")
    g.add_argument("lab", help="lab folder (or a lab's name under labs/)")
    g.add_argument("submissions", nargs="+", metavar="SUBMISSION",
                   help="<student>.ipynb, <student>/lab.ipynb or <student>/")
    g.add_argument("-j", "--jobs", type=int, default=1, help="submissions run at the same time (default 1)")
    g.add_argument("--out", help="report folder (default: build/grades/<lab> under the current folder)")
    g.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="grading parameter over lab.yaml's (VALUE read as JSON, else as text); repeatable")
    g.add_argument("--cell-timeout", type=float, metavar="S", help="per-cell limit (default: lab.yaml)")
    g.add_argument("--total-timeout", type=float, metavar="S", help="whole-notebook limit (default: lab.yaml)")
    g.add_argument("--memory-mb", type=int, metavar="MIB", help="memory limit (default: lab.yaml, else 4096)")
    g.add_argument("--allow-network", action="store_true", help="let submissions use the network")
    g.add_argument("--no-sandbox", action="store_true",
                   help="run submissions unconfined as your own user (debugging a lab only; noted in every result)")
    g.add_argument("--no-reverify", action="store_true",
                   help="do not re-run a sample of each submission's runs to check them (debugging a lab only; "
                        "noted in every result)")
    g.add_argument("--hide", action="append", default=[], metavar="PATH",
                   help="another path submissions must not see (e.g. a copy of hidden checks); repeatable")
    g.add_argument("--workdir", help="where job folders are made (default: the temporary folder)")
    g.add_argument("--keep-workdirs", action="store_true", help="keep each job folder (for debugging)")
    g.add_argument("--job-mb", type=int, default=2048, metavar="MIB",
                   help="as root, each job folder is a tmpfs of this size (default 2048): a run cannot fill the "
                        "disk; 0: not capped")
    g.add_argument("--slurm", action="store_true",
                   help="run each submission's sandboxed job as a Slurm job on the grading partition (as root); "
                        "checks and scores stay here. --workdir must be shared with the grading nodes")
    g.add_argument("--partition", metavar="NAME", help="with --slurm: the grading partition (default: grading)")
    g.add_argument("--slurm-cpus", type=int, default=2, metavar="N",
                   help="with --slurm: CPUs per submission's job (default 2)")
    g.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    g.set_defaults(func=grade_command)

    labs = subparsers.add_parser("labs", help="instructor tools for the labs (release)")
    actions = labs.add_subparsers(dest="labs_command", metavar="ACTION")
    r = actions.add_parser("release", help="build the student copies: solutions removed, outputs stripped, "
                                           "hidden checks left out")
    r.add_argument("labs", nargs="*", metavar="LAB", help="lab names or folders (default: every lab)")
    r.add_argument("--labs-root", help="where the reference labs are (default: the repository's labs/)")
    r.add_argument("--out", help=f"where the student copies go (default: {student_labs_dir()}, where "
                                 "`scalelab hub` hands them out from)")
    r.set_defaults(func=release_command)
    run = actions.add_parser("run", help="execute a lab's reference notebook with a parameter profile (demos, "
                                         "checking a lab on a GPU node)")
    run.add_argument("lab", help="lab folder (or a lab's name under labs/)")
    run.add_argument("--profile", default="ci", help="ci (the grader's), laptop (the notebook's defaults), or one of "
                                                     "lab.yaml's profiles: e.g. demo, gpu-node (default %(default)s)")
    run.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a parameter over the profile's")
    run.add_argument("--out", help="folder for the run (default build/runs/<lab>-<profile>)")
    run.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="whole-notebook limit (default: none for demos, lab.yaml's for ci)")
    run.set_defaults(func=labs_run_command)
    up = actions.add_parser("update", help="bring the current labs into every student's home now; a student's "
                                           "edited file is kept and the new version put beside it")
    up.add_argument("--config", help="the hub's course settings (default hub_config/course.yaml)")
    up.add_argument("--users", help="students, comma-separated (default: the hub's class list)")
    up.add_argument("--homes", metavar="TEMPLATE", help="each student's home, with {username}")
    up.set_defaults(func=labs_update_command)
    labs.set_defaults(func=lambda args: (labs.print_help(), 2)[1])


def labs_run_command(args) -> int:
    """`scalelab labs run`: 0 when the notebook ran to the end."""
    import shutil
    from pathlib import Path
    from ..course.execute import execute_notebook
    from ..course.lab import NOTEBOOK, load_lab, student_files
    from ..course.release import resolve_lab
    lab = load_lab(resolve_lab(args.lab))
    params = {**lab.profile(args.profile), **_parameters(args.set)}
    work = Path(args.out or Path("build") / "runs" / f"{lab.name}-{args.profile}").resolve()
    for rel in student_files(lab.path):
        if rel != Path(NOTEBOOK):
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lab.path / rel, work / rel)
    total = args.timeout if args.timeout is not None else (lab.grading.total_timeout_s if args.profile == "ci"
                                                           else None)
    print(f"running {lab.name} with profile {args.profile} {params or '(the notebook defaults)'} in {work}",
          file=sys.stderr, flush=True)
    result = execute_notebook(lab.notebook, params, output_path=work / NOTEBOOK, cwd=work,
                              cell_timeout=None if total is None else lab.grading.cell_timeout_s,
                              total_timeout=total)
    print(f"{lab.name}: {result.status} in {result.duration_s:.0f} s; executed notebook: {result.output_path}")
    if result.error is not None:
        print(str(result.error), file=sys.stderr)
    return 0 if result.ok else 1


def labs_update_command(args) -> int:
    """`scalelab labs update`: hand the labs out to every home now (as each home's owner), never overwriting."""
    from ..cli.course import student_homes
    from ..hub.provision import resolve_source
    from ..hub.settings import load_settings
    homes, dest = student_homes(args)
    cfg = load_settings(args.config)
    source = resolve_source(cfg["labs"]["source"])
    if source is None:
        raise GradingError(f"labs.source {cfg['labs']['source']!r}: no labs there; run `scalelab labs release`")
    from ..course.collect import OwnerError, owner_python, printable, run_as_owner
    argv = owner_python("scalelab.hub.provision", str(source), ".", "--dest", dest,
                        *[f"--exclude={x}" for x in cfg["labs"]["exclude"]])
    for student, home in sorted(homes.items()):
        try:
            r = run_as_owner(home, argv)
            said = (r.stderr.decode(errors="replace").strip().splitlines() or [f"exit {r.returncode}"])[-1]
        except OwnerError as e:
            said = f"not updated: {e}"
        except subprocess.TimeoutExpired as e:  # one student's home never stops the others'
            said = (f"not updated: the copy took longer than {e.timeout:.0f} s (a huge file in the home?); the other "
                    "students go on")
        except OSError as e:
            said = f"not updated: {e}"
        print(f"{student:<20} {printable(said.removeprefix('scalelab provision: '))}")
    return 0


def _parameters(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise GradingError(f"--set {pair!r}: expected NAME=VALUE, e.g. --set steps=5")
        try:
            out[name] = json.loads(value)
        except ValueError:
            out[name] = value
    return out


def grade_command(args) -> int:
    """`scalelab grade`: 0 when every submission was graded, 1 when the grader failed on one."""
    from ..grade.grader import GradeOptions, grade
    from ..grade.slurm_grading import SlurmGrading
    from ..course.release import resolve_lab
    if args.jobs < 1:
        raise GradingError(f"-j/--jobs must be >= 1, got {args.jobs}")
    if args.job_mb < 0:
        raise GradingError(f"--job-mb must be a size in MiB (0: not capped), got {args.job_mb}")
    if (args.partition or args.slurm_cpus != 2) and not args.slurm:
        raise GradingError("--partition and --slurm-cpus choose how --slurm grades: add --slurm, or leave them out "
                           "to grade on this host")
    slurm = SlurmGrading(partition=args.partition or "grading", cpus=args.slurm_cpus) if args.slurm else None
    options = GradeOptions(jobs=args.jobs, parameters=_parameters(args.set) or None,
                           cell_timeout_s=args.cell_timeout, total_timeout_s=args.total_timeout,
                           memory_mb=args.memory_mb, network=True if args.allow_network else None,
                           sandbox=not args.no_sandbox, hide=tuple(args.hide), workdir=args.workdir,
                           keep_workdirs=args.keep_workdirs, job_mb=args.job_mb or None,
                           reverify=not args.no_reverify, slurm=slurm)

    def progress(r):
        if not args.json:
            print(f"  graded {r.student}: {r.score:g}/{r.max_score:g} ({r.status})", file=sys.stderr, flush=True)

    batch = grade(resolve_lab(args.lab), args.submissions, args.out, options, progress)
    for folder in batch.reaped:
        print(f"note: cleaned up {folder}, left by a grader that died mid-batch (its runs ended, its job folders "
              "unmounted)", file=sys.stderr)
    if args.json:
        from ..grade.report import result_to_dict
        print(json.dumps({"lab": batch.lab, "out": str(batch.out_dir), "gradebook": str(batch.gradebook),
                          "duration_s": round(batch.duration_s, 2),
                          "results": [result_to_dict(r) for r in batch.results]}, indent=1, default=str))
    else:
        _table(batch)
    return 1 if any(r.status == "grader_error" for r in batch.results) else 0


def _table(batch) -> None:
    width = max([7, *(len(r.student) for r in batch.results)])
    print(f"{'student':<{width}}  {'score':>9}  {'%':>6}  {'status':<12}  message")
    for r in batch.results:
        score = f"{r.score:g}/{r.max_score:g}"
        print(f"{r.student:<{width}}  {score:>9}  {r.percent:>6.1f}  {r.status:<12}  {r.message[:70]}")
    sandbox = batch.results[0].sandbox if batch.results else {}
    for note in sandbox.get("notes", []):
        print(f"note: {note}")
    print(f"{len(batch.results)} graded in {batch.duration_s:.1f} s; gradebook {batch.gradebook}, feedback in "
          f"{batch.out_dir / 'feedback'}")


def release_command(args) -> int:
    """`scalelab labs release`: write the student copies and say what each got."""
    from ..course.release import release_labs
    from ..paths import labs_dir, student_labs_dir
    reports = release_labs(args.labs or None, args.labs_root or labs_dir(), args.out or student_labs_dir())
    for rep in reports:
        left = f"; left out {', '.join(rep.left_out)}" if rep.left_out else ""
        print(f"{rep.lab}: {rep.exercises} exercise(s), {len(rep.files)} file(s) -> {rep.out}{left}")
    return 0
