"""A real single-node Slurm on this machine, for development, tests, the Slurm launcher and the hub's batchspawner.

    sudo scalelab cluster up           # munged + slurmctld + slurmd; prints the line below
    export SLURM_CONF=/var/lib/scalelab/cluster/slurm.conf
    sbatch -n 2 --wrap 'srun hostname'
    scalelab cluster status            # or --json; exit 3 when down
    sudo scalelab cluster down

Everything (slurm.conf, the munge key and socket, spool, logs, pid files) lives in one state directory, by default
$SCALELAB_CLUSTER_DIR, else /var/lib/scalelab/cluster when run as root (readable by every user, so students'
jobs can be submitted through it), else ~/.cache/scalelab/cluster. A client process needs only `LocalCluster.env()`: SLURM_CONF.
The configuration itself (and why each setting) is in `scalelab.cluster.conf`; `scalelab.cli.cluster` is the CLI.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from . import accounting
from .accounting import DBD_PORT
from .conf import (CTLD_PORT, SLURMD_PORT, StatePaths, detect_machine, gres_conf_text, node_usable, parse_scontrol,
                   slurm_conf_text, summarise)
from .job_end import install_scripts
from ..errors import ClusterError
from ..paths import cluster_state_dir
from ..run.procs import kill_processes

__all__ = ["LocalCluster", "default_state_dir", "slurm_conf_text"]

DAEMONS = ("munged", "slurmctld", "slurmd")  # start order; stopped in reverse
DB_DAEMONS = ("mariadbd", "slurmdbd")  # with accounting: started after munged, before slurmctld
INSTALL = "apt-get install slurm-wlm munge slurmdbd mariadb-server"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


def default_state_dir() -> Path:
    """$SCALELAB_CLUSTER_DIR; else /var/lib/scalelab/cluster as root, ~/.cache/scalelab/cluster otherwise.

    Root's home is usually 0700: a state directory there would hide slurm.conf and the munge socket from the
    students whose jobs the hub submits, so the root default lives where every user can read it.
    (`paths.cluster_state_dir`: the grader hides it from submissions too.)
    """
    return cluster_state_dir()


class LocalCluster:
    """munged, slurmctld and slurmd on this machine, all state in one directory; `up()` and `down()` are idempotent."""

    def __init__(self, state_dir: str | os.PathLike | None = None, *, ctld_port: int = CTLD_PORT,
                 slurmd_port: int = SLURMD_PORT, accounting: bool = True, dbd_port: int = DBD_PORT):
        self.state_dir = Path(state_dir or default_state_dir()).expanduser().absolute()
        self.ports = (ctld_port, slurmd_port)  # only a second cluster beside the default one needs others
        # accounting: our own MariaDB + slurmdbd, associations and the per-student QOS (scalelab.cluster.accounting)
        self.accounting = accounting
        self.dbd_port = dbd_port
        self.paths = StatePaths(self.state_dir)
        self.conf_path = self.paths.conf
        self.log_dir = self.paths.log_dir

    def __repr__(self) -> str:
        return f"LocalCluster(state_dir={str(self.state_dir)!r})"

    def env(self) -> dict[str, str]:
        """Environment a client process (sbatch, squeue, scancel, srun) needs: only SLURM_CONF (munge is in it)."""
        return {"SLURM_CONF": str(self.conf_path)}

    # -- client commands --------------------------------------------------------------------------------------

    def run(self, *cmd: str, timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; raise ClusterError (with its output) when it fails."""
        try:
            r = subprocess.run(cmd, env={**os.environ, **self.env()}, capture_output=True, text=True,
                               timeout=timeout, **kw)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`{' '.join(cmd)}` did not answer in {timeout:g} s; see {self.paths.ctld_log}")
        except FileNotFoundError:
            raise ClusterError(f"{cmd[0]} not found; run `{INSTALL}`") from None
        if check and r.returncode:
            raise ClusterError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}"
                               f"; see {self.paths.ctld_log}")
        return r

    def _nodes(self) -> list[dict]:
        return parse_scontrol(self.run("scontrol", "show", "node", "-o", timeout=15).stdout, "NodeName")

    @staticmethod
    def _usable(nodes: list[dict]) -> bool:
        return bool(nodes) and all(node_usable(n.get("State", "")) for n in nodes)

    # -- daemons ----------------------------------------------------------------------------------------------

    @property
    def daemons(self) -> tuple[str, ...]:
        """This cluster's daemons in start order: munged, (mariadbd, slurmdbd with accounting), slurmctld, slurmd."""
        return DAEMONS[:1] + (DB_DAEMONS if self.accounting else ()) + DAEMONS[1:]

    def _pid_file(self, daemon: str) -> Path:
        return {"munged": self.paths.munge_pid, "slurmctld": self.paths.ctld_pid, "slurmd": self.paths.slurmd_pid,
                "mariadbd": self.paths.db_pid, "slurmdbd": self.paths.dbd_pid}[daemon]

    def _pid(self, daemon: str) -> int | None:
        """Pid of our `daemon` from its pid file, or None if the file is missing or stale (dead or another program)."""
        try:
            pid = int(self._pid_file(daemon).read_text().split()[0])
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            return None
        return pid if comm == daemon[:15] and not _zombie(pid) else None

    def _running(self) -> dict[str, int | None]:
        return {d: self._pid(d) for d in self.daemons}

    def pids(self) -> dict[str, int | None]:
        """The pid of each of our daemons (munged, mariadbd, slurmdbd, slurmctld, slurmd); None for one not running."""
        return self._running()

    def _healthy(self) -> bool:
        if not all(self._running().values()):
            return False
        try:
            return self._usable(self._nodes())
        except ClusterError:
            return False

    @contextlib.contextmanager
    def _locked(self):
        """Serialise up()/down() between processes (two pytest sessions may both call up())."""
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            f = open(self.paths.lock, "a")
        except PermissionError as e:
            raise ClusterError(f"cannot write the cluster's state directory ({e}); the local cluster is run by "
                               "root: use `sudo scalelab cluster up|down`") from None
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _preflight(self) -> None:
        needed = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "scontrol")
        needed += ("mariadbd", "mariadb-install-db", "slurmdbd", "sacctmgr", "unshare") if self.accounting else ()
        missing = [b for b in needed
                   if not shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
        if missing:
            raise ClusterError(f"{', '.join(missing)} not found; run `{INSTALL}`")
        if os.geteuid() != 0:
            raise ClusterError(
                f"the local cluster runs munged, slurmctld and slurmd, which need root (you are uid {os.geteuid()}): "
                "run `sudo scalelab cluster up`, or use an existing Slurm cluster instead by pointing scalelab at it "
                "with `export SLURM_CONF=/path/to/slurm.conf` (unset means /etc/slurm/slurm.conf)")

    def up(self, timeout: float = 60) -> "LocalCluster":
        """Start munged, slurmctld and slurmd unless already healthy with this version's slurm.conf (a cluster left
        running by an older scalelab is restarted with the new one); return once a job runs on the node."""
        if self._healthy() and self._conf_current():
            self._seal_accounting()  # a cluster an older release left running: its job log closed now
            return self
        self._preflight()
        deadline = time.monotonic() + timeout
        with self._locked():
            if self._healthy() and self._conf_current():  # another process brought it up while we waited
                return self
            self._stop_all()  # whatever is left half-started, ours only
            self._check_ports()
            self._prepare()
            self._start("munged", ["munged", "--key-file", str(self.paths.munge_key), "--socket",
                                   str(self.paths.munge_socket), "--pid-file", str(self.paths.munge_pid),
                                   "--log-file", str(self.paths.munge_log), "--seed-file",
                                   str(self.paths.munge_seed), "--force"])
            self._check_munge()
            if self.accounting:
                self._start_accounting(deadline)
            self._start("slurmctld", ["slurmctld", "-f", str(self.conf_path)])
            self._start("slurmd", ["slurmd", "-f", str(self.conf_path)])
            self._wait_usable(deadline)
            self._probe(deadline)
        return self

    # -- accounting: MariaDB, slurmdbd, associations, the student QOS ------------------------------------------

    def _start_accounting(self, deadline: float) -> None:
        """MariaDB on its private socket (its data folder made once), slurmdbd, then the course's cluster, account,
        student QOS and every account's association, before slurmctld starts (it registers with slurmdbd)."""
        p = self.paths
        p.db_dir.mkdir(mode=0o700, exist_ok=True)
        p.db_dir.chmod(0o700)  # the database, its socket and logs: root's alone
        if not (p.db_data / "mysql").is_dir():
            out = subprocess.run(accounting.mariadb_install_args(p.db_data), capture_output=True, text=True,
                                 timeout=120, env=self._daemon_env())
            if out.returncode:
                raise ClusterError(f"mariadb-install-db failed (exit {out.returncode}): "
                                   f"{(out.stdout + out.stderr).strip()[-400:]}")
        # mariadbd stays in the foreground: setsid -f detaches it (its parent is init, not this process)
        self._start("mariadbd", ["setsid", "-f", *accounting.mariadb_args(
            datadir=p.db_data, socket=p.db_socket, pid_file=p.db_pid, log_file=p.db_log)])
        self._wait_for(lambda: _connects_unix(p.db_socket), deadline, "mariadbd", p.db_log)
        self._start("slurmdbd", accounting.slurmdbd_command(),  # listening on 127.0.0.1 only
                    env={"SLURM_CONF": str(self.conf_path), "MYSQL_UNIX_PORT": str(p.db_socket)})
        self._wait_for(lambda: _connects_tcp(self.dbd_port), deadline, "slurmdbd", p.dbd_log)
        accounting.ensure_course_setup(self.env(), self.cluster_name)

    def _wait_for(self, ready, deadline: float, daemon: str, log: Path) -> None:
        while not ready():
            if not self._pid(daemon):
                raise ClusterError(f"{daemon} exited during start-up; see {log}: {_tail(log)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{daemon} did not answer in time; see {log}: {_tail(log)}")
            time.sleep(0.05)

    @property
    def cluster_name(self) -> str:
        """ClusterName in slurm.conf (and the cluster in slurmdbd)."""
        return "scalelab"

    def set_student_limits(self, cpus: int, gpus: int) -> None:
        """The student QOS's MaxTRESPerUser: what one course account's jobs may hold at once (0 = no cap). The
        number is the hub's (`hub.options.student_limits`); GPUs are capped only where the node has GPUs (a TRES)."""
        if not self.accounting:
            raise ClusterError(f"{self} runs without accounting: no QOS to set")
        has_gpus = "AccountingStorageTRES=gres/gpu" in self.conf_path.read_text()
        accounting.sacctmgr(accounting.qos_limit_command(cpus, gpus if has_gpus else None), self.env())

    def student_limits(self) -> str:
        """The student QOS's MaxTRESPerUser as sacctmgr shows it ("cpu=2", "" = no cap)."""
        r = accounting.sacctmgr(["sacctmgr", "-n", "-P", "show", "qos", accounting.STUDENT_QOS,
                                 "format=MaxTRESPerUser"], self.env())
        return r.stdout.strip()

    def register_user(self, name: str, student: bool | None = None) -> None:
        """An association for `name` (a course account: with the student QOS); no-op without accounting."""
        if self.accounting:
            accounting.register_user(name, self.conf_path, student=student)

    def _check_ports(self) -> None:
        """Fail clearly when another Slurm (another state directory, or a system one) holds our ports."""
        for port in self.ports + ((self.dbd_port,) if self.accounting else ()):
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex(("127.0.0.1", port)) != 0:
                    continue
            others = "; ".join(_daemon_cmdlines()) or "a process that is not slurmctld/slurmd"
            raise ClusterError(f"port {port} is already in use (by {others}): stop that cluster first (e.g. "
                               "`scalelab cluster down --state-dir DIR`), or give this one other ports "
                               "(LocalCluster(ctld_port=..., slurmd_port=...))")

    def _conf_text(self, m=None) -> str:
        """The slurm.conf this version of scalelab writes for this machine."""
        m = m or detect_machine()
        return slurm_conf_text(cluster_name="scalelab", node_name=m.hostname, cpus=m.cpus,
                               real_memory_mb=m.memory_mb, gpus=m.gpus, state_dir=self.state_dir,
                               node_addr=m.node_addr, sockets=m.sockets, cores_per_socket=m.cores_per_socket,
                               threads_per_core=m.threads_per_core, ctld_port=self.ports[0],
                               slurmd_port=self.ports[1], dbd_port=self.dbd_port if self.accounting else None)

    def _conf_current(self) -> bool:
        """Whether the running cluster's slurm.conf is the one this version would write."""
        try:
            return self.conf_path.read_text() == self._conf_text()
        except OSError:
            return False

    def _prepare(self) -> None:
        """State directories, a fresh slurm.conf for this machine, and a munge key if there is none yet."""
        p = self.paths
        for d in (p.log_dir, p.run_dir, p.ctld_state, p.slurmd_spool, p.munge_dir):
            d.mkdir(parents=True, exist_ok=True)
        # Readable by everyone (as /etc/slurm is) so other local users can submit; the key stays 0600.
        for d in (self.state_dir, p.log_dir, p.run_dir, p.munge_dir):
            d.chmod(0o755)
        self._seal_accounting()
        install_scripts(p.epilog, p.task_prolog)
        m = detect_machine()
        self.conf_path.write_text(self._conf_text(m))
        if self.accounting:
            fd = os.open(p.dbd_conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:  # slurmdbd refuses a slurmdbd.conf others can read
                os.fchmod(f.fileno(), 0o600)
                f.write(accounting.slurmdbd_conf_text(state_dir=self.state_dir, dbd_port=self.dbd_port,
                                                      munge_socket=p.munge_socket, log_file=p.dbd_log,
                                                      pid_file=p.dbd_pid))
        else:
            p.dbd_conf.unlink(missing_ok=True)
        gres = gres_conf_text(node_name=m.hostname, gpus=m.gpus, files=m.gpu_files)
        if gres:
            p.gres_conf.write_text(gres)
        if not p.munge_key.exists():
            fd = os.open(p.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(128))

    def _seal_accounting(self) -> None:
        """The job completion log holds every job's user, nodes, times and exit code (what PrivateData hides from
        squeue): root's alone (SlurmUser is root), made 0600 before slurmctld first opens it (jobcomp/filetxt would
        create it 0644) and closed again when one made by an older release is found. Another account's `cluster
        up` on a running cluster cannot, and need not: the file is root's."""
        try:
            fd = os.open(self.paths.jobcomp_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            if os.fstat(fd).st_mode & 0o077:
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)

    @staticmethod
    def _daemon_env(extra: dict | None = None) -> dict:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(Path.home()), "LANG": "C.UTF-8", **(extra or {})}

    def _start(self, daemon: str, cmd: list[str], env: dict | None = None) -> None:
        """Start one daemon (it forks into the background itself) and wait for its pid file."""
        out = self.paths.log_dir / f"{daemon}.start.txt"
        env = self._daemon_env(env)
        with open(out, "w") as f:
            rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=60).returncode
        log = self.paths.log_dir / f"{daemon}.log"
        for _ in range(200):
            if self._pid(daemon):
                return
            if rc:
                break
            time.sleep(0.1)
        raise ClusterError(f"{daemon} did not start (exit {rc}): {out.read_text().strip()[-400:]}; "
                           f"command: {' '.join(cmd)}; log: {log}")

    def _check_munge(self) -> None:
        sock = str(self.paths.munge_socket)
        cred = subprocess.run(["munge", "-n", "-S", sock], capture_output=True, text=True, timeout=10)
        back = subprocess.run(["unmunge", "-S", sock], input=cred.stdout, capture_output=True, text=True, timeout=10)
        if cred.returncode or back.returncode:
            raise ClusterError(f"munged runs but `munge -n -S {sock} | unmunge -S {sock}` fails: "
                               f"{(cred.stderr + back.stderr).strip()}; log: {self.paths.munge_log}")

    def _wait_usable(self, deadline: float) -> None:
        """Wait until the node is usable; resume it once if slurmctld kept it DOWN/DRAINED from an earlier run."""
        resumed: set[str] = set()
        nodes: list[dict] = []
        while time.monotonic() < deadline:
            for d, pid in self._running().items():
                if not pid:
                    log = self.log_dir / f"{d}.log"
                    raise ClusterError(f"{d} exited during start-up; see {log}: {_tail(log)}")
            with contextlib.suppress(ClusterError):
                nodes = self._nodes()
                if self._usable(nodes):
                    return
                self._resume_kept_down(nodes, resumed)
            time.sleep(0.2)
        raise ClusterError(f"the node did not become usable in time (found {_described(nodes)}); see "
                           f"`SLURM_CONF={self.conf_path} scontrol show node` and {self.paths.slurmd_log}")

    def _resume_kept_down(self, nodes: list[dict], resumed: set[str]) -> None:
        """Resume, once each, the nodes slurmctld kept DOWN or DRAINED from an earlier run (not one whose slurmd does
        not answer: resuming cannot help it)."""
        for n in nodes:
            s = n.get("State", "")
            if n["NodeName"] not in resumed and ("DRAIN" in s or s.startswith("DOWN")) \
                    and "NOT_RESPONDING" not in s and not s.endswith("*"):
                self.run("scontrol", "update", f"NodeName={n['NodeName']}", "State=RESUME", check=False)
                resumed.add(n["NodeName"])

    def _probe(self, deadline: float) -> None:
        """Run one tiny job through slurmctld, slurmd and slurmstepd: the proof that sbatch/srun work."""
        left = max(5.0, deadline - time.monotonic())
        r = self.run("srun", "--quiet", "-J", "scalelab-probe", "-n", "1", "-t", "1", "--mem=10",
                     "true", timeout=left, check=False)
        if r.returncode:
            raise ClusterError(f"the daemons run but a test job failed (`srun -n 1 true`, exit {r.returncode}): "
                               f"{r.stderr.strip()[-400:]}; see {self.paths.slurmd_log} (a reservation without "
                               "root, or a full node, keeps it pending: `squeue`, `scontrol show reservation`)")

    def down(self) -> None:
        """Stop the daemons this state directory started (by pid file); the state directory is kept."""
        if not self.state_dir.exists():
            return
        with self._locked():
            self._stop_all()

    def _stop_all(self) -> None:
        # slurmd, slurmctld, then accounting's two together (their own shutdowns, ~2 s each, side by side), munged
        for group in (("slurmd",), ("slurmctld",), DB_DAEMONS, ("munged",)):  # accounting's even if now off
            pids = []
            for daemon in group:
                pid = self._pid(daemon)
                if pid:
                    try:
                        os.kill(pid, 0)  # may we signal it at all? (kill_processes skips what it may not)
                    except PermissionError:
                        raise ClusterError(f"{daemon} (pid {pid}) belongs to root: run `sudo scalelab cluster down`")
                    except ProcessLookupError:
                        pass
                    else:
                        pids.append(pid)
            if pids:
                kill_processes(pids, grace_s=15, tree=False)
            for daemon in group:
                self._pid_file(daemon).unlink(missing_ok=True)

    # -- queries ----------------------------------------------------------------------------------------------

    def status(self) -> dict:
        """{"up", "conf", "nodes", "partitions", "jobs"}: a few scontrol calls, none when the daemons are down."""
        result = {"up": False, "conf": str(self.conf_path), "nodes": [], "partitions": [], "jobs": 0}
        if not all(self._running().values()):
            return result
        try:
            nodes = self._nodes()
            parts = parse_scontrol(self.run("scontrol", "show", "partition", "-o").stdout, "PartitionName")
            jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
        except ClusterError:
            return result
        return {**result, **summarise(nodes, parts), "jobs": len(jobs)}

    # -- reservations and users -------------------------------------------------------------------------------

    def ensure_reservation(self, name: str, users=("root",), duration: str = "1-00:00:00") -> None:
        """Create a whole-node reservation for `users` (list or "a,b"; root always added), or update its users."""
        names = [u.strip() for u in (users.split(",") if isinstance(users, str) else users) if u.strip()]
        if not _NAME.match(name):
            raise ClusterError(f"reservation name {name!r} is not valid: use letters, digits, '_', '.', '-'")
        bad = [u for u in names if not _USER.match(u)]
        if bad:
            raise ClusterError(f"reservation {name}: bad user name(s) {bad}; give Unix user names")
        unknown = [u for u in names if not _user_exists(u)]
        if unknown:
            raise ClusterError(f"reservation {name}: no such Unix user(s) {unknown}; Slurm needs local users "
                               "(create them with LocalCluster.ensure_user or useradd -m)")
        # This one node is all the cluster has: a reservation locks out every job that is not in it. root stays in
        # the list and MAGNETIC pulls its jobs in even without --reservation, so the launcher, the tests and the
        # admin keep working; users who are not listed wait until the reservation ends.
        names = sorted(set(names) | {"root"})
        existing = self._reservation(name)
        if existing is None:
            # IGNORE_JOBS: the node may be running jobs (hub servers) right now; the reservation still starts.
            # OVERLAP: a test's reservation may coexist with the hub's class reservation on the same node.
            self.run("scontrol", "create", "reservation", f"ReservationName={name}", f"Users={','.join(names)}",
                     "StartTime=now", f"Duration={duration}", "Nodes=ALL", "Flags=IGNORE_JOBS,OVERLAP,MAGNETIC")
        elif sorted(existing.get("Users", "").split(",")) != names or "MAGNETIC" not in existing.get("Flags", ""):
            self.run("scontrol", "update", f"ReservationName={name}", f"Users={','.join(names)}", "Flags+=MAGNETIC")

    def drop_reservation(self, name: str, wait_s: float = 0.0, cancel_jobs: bool = False) -> None:
        """Delete a reservation if it exists. Slurm refuses while a job of it has not ended: this waits up to
        `wait_s` seconds for them; with `cancel_jobs` it then cancels them (scancel --reservation) and waits once
        more. ClusterError if the reservation is still there: a reservation left behind holds its cores for
        everyone else until it ends."""
        deadline, cancelled = time.monotonic() + wait_s, False
        while self._reservation(name) is not None:
            r = self.run("scontrol", "delete", f"ReservationName={name}", check=False)
            if r.returncode == 0:
                return
            if time.monotonic() >= deadline:
                if not cancel_jobs or cancelled:
                    raise ClusterError(f"reservation {name} could not be deleted: {(r.stderr or r.stdout).strip()} "
                                       f"(its jobs: `squeue -R {name}`; scancel them, then `scontrol delete "
                                       f"ReservationName={name}`)")
                self.run("scancel", f"--reservation={name}", check=False)
                deadline, cancelled = time.monotonic() + max(wait_s, 30.0), True
            time.sleep(1)

    def _reservation(self, name: str) -> dict | None:
        r = self.run("scontrol", "show", "reservation", name, "-o", check=False)
        found = parse_scontrol(r.stdout, "ReservationName") if r.returncode == 0 else []
        return next((x for x in found if x.get("ReservationName") == name), None)

    def ensure_user(self, username: str) -> None:
        """Create the local Unix user `username` with a home directory (useradd -m) unless it exists, and give it
        its association when this cluster runs with accounting (a person's: no student QOS)."""
        self._ensure_unix_user(username)
        if self.accounting and self.paths.dbd_pid.exists() and self._pid("slurmdbd"):
            self.register_user(username)

    def _ensure_unix_user(self, username: str) -> None:
        if not _USER.match(username):
            raise ClusterError(f"user name {username!r} is not valid: lower-case letters, digits, '_', '-'")
        if _user_exists(username):
            return
        if os.geteuid() != 0:
            raise ClusterError(f"creating user {username!r} needs root: run `sudo useradd -m {username}`")
        r = subprocess.run(["useradd", "-m", "-s", "/bin/bash", username], capture_output=True, text=True)
        if r.returncode and not _user_exists(username):
            raise ClusterError(f"`useradd -m {username}` failed (exit {r.returncode}): {r.stderr.strip()}")


def _user_exists(name: str) -> bool:
    try:
        return bool(pwd.getpwnam(name))
    except KeyError:
        return False


def _daemon_cmdlines() -> list[str]:
    """Command lines of every slurmctld/slurmd on the machine (to name who holds a port)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if (proc / "comm").read_text().strip() in ("slurmctld", "slurmd"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                found.append(f"pid {proc.name}: {cmdline}")
    return found


def _connects_unix(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(str(path)) == 0


def _connects_tcp(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _described(nodes: list[dict]) -> str:
    """Each node's name, state and reason, for an error message."""
    return "; ".join(f"{n.get('NodeName')}: {n.get('State')} {n.get('Reason', '')}".strip() for n in nodes) \
        or "no node"


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
