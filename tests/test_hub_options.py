"""Bounds on what a student may ask for, the spawn form, and the batch script as text."""
from __future__ import annotations

import pytest

from scalelab.hub.batch import render_batch_script
from scalelab.hub.options import (OptionError, Profile, format_walltime, options_form_html, options_from_form,
                                  parse_walltime, profiles_from_settings, resolve_options)
from scalelab.hub.settings import load_settings

SLURM = load_settings()["slurm"]


def profiles(**course):
    return profiles_from_settings({**SLURM, **course})


def test_course_values_fill_profiles_that_leave_them_empty():
    ps = profiles(account="proj", reservation="class", qos="")
    assert {p.reservation for p in ps} == {"class"} and {p.account for p in ps} == {"proj"}
    own = profiles_from_settings({"reservation": "class", "profiles": [
        {"name": "x", "display_name": "X", "partition": "cpu", "walltime": "1:00:00", "reservation": "mine"}]})
    assert own[0].reservation == "mine"


@pytest.mark.parametrize("text, seconds", [(90, 5400), ("90", 5400), ("1:30:00", 5400), ("2-01:00:00", 176400),
                                           ("0:01:30", 90)])
def test_walltime_parsing(text, seconds):
    assert parse_walltime(text) == seconds


@pytest.mark.parametrize("bad", ["1:30", "2h", "", "-5", 0, True, None, "1:00:00\n#SBATCH --x", 1.5])
def test_walltime_refuses_what_slurm_could_misread(bad):
    with pytest.raises(OptionError):
        parse_walltime(bad)


@pytest.mark.parametrize("zero", ["0", 0, "00", "0:00:00", "00:00:00", "0-0:00:00", "0-00:00:00", "000-000:00:00",
                                  "0:00:59", "0-00:00:30"])
def test_every_spelling_of_no_time_is_refused(zero):
    # Slurm reads --time=0 as no limit at all (TimeLimit=UNLIMITED): no form may get a zero or sub-minute limit past.
    with pytest.raises(OptionError, match="at least 1 minute"):
        parse_walltime(zero)


@pytest.mark.parametrize("long", [44641, "44641", "31-00:00:01", "999-00:00:00", "744:00:01"])
def test_every_spelling_of_too_much_time_is_refused(long):
    with pytest.raises(OptionError, match="longer than 31 days"):
        parse_walltime(long)


@pytest.mark.parametrize("odd", ["²", "٣", "1:3O:00", "1-1-1:00:00", "1 :00:00", "9" * 10])
def test_non_ascii_or_malformed_digits_are_refused_not_crashed_on(odd):
    with pytest.raises(OptionError, match="not a duration"):
        parse_walltime(odd)


@pytest.mark.parametrize("zero", ["0:00:00", "0-0:00:00", "0"])
def test_a_zero_walltime_is_refused_when_resolving_options(zero):
    with pytest.raises(OptionError, match="at least 1 minute"):
        resolve_options({"profile": "cpu-2h", "walltime": zero}, profiles())


def test_format_walltime():
    assert format_walltime(5400) == "1:30:00" and format_walltime(90000) == "1-01:00:00"


def test_no_options_gives_the_default_profile_with_its_full_time():
    r = resolve_options({}, profiles(), "cpu-2h")
    assert r.profile.name == "cpu-2h" and r.walltime == "2:00:00"
    assert r.to_user_options() == {"profile": "cpu-2h", "walltime": "2:00:00"}


def test_a_shorter_walltime_is_granted():
    assert resolve_options({"profile": "gpu1-2h", "walltime": "0:45:00"}, profiles()).seconds == 2700


@pytest.mark.parametrize("options, message", [
    ({"profile": "cpu-2h", "walltime": "3:00:00"}, "longer than profile 'CPU, 2 h' allows (2:00:00)"),
    ({"profile": "cpu-2h", "walltime": 100000}, "longer than"),
    ({"profile": "huge"}, "profile 'huge' does not exist"),
    ({"profile": ["cpu-2h", "gpu1-2h"]}, "does not exist"),
    ({"profile": "cpu-2h", "reservation": "other"}, "['reservation'] cannot be set"),
    ({"profile": "cpu-2h", "gpus_per_node": 8}, "cannot be set"),
    ({"profile": "cpu-2h", "options": "#SBATCH --exclusive"}, "cannot be set"),
    ({"profile": "cpu-2h", "walltime": "1:00:00\n#SBATCH --reservation=x"}, "not a duration"),
])
def test_out_of_bounds_options_are_refused_with_what_is_allowed(options, message):
    with pytest.raises(OptionError) as e:
        resolve_options(options, profiles(), "cpu-2h")
    assert message in str(e.value)


def test_profiles_on_missing_partitions_are_refused():
    with pytest.raises(OptionError, match="not available on this cluster"):
        resolve_options({"profile": "gpu1-2h"}, profiles(), "cpu-2h", unavailable={"gpu1-2h"})


def test_a_profile_asking_for_gpus_a_partition_lacks_is_refused_with_why():
    from scalelab.hub.options import partition_gpus, unavailable_reasons
    parts = partition_gpus("cpu|(null)\ngpu|gpu:a100:2(S:0,1),mps:100\ngpu|gpu:4")
    assert parts == {"cpu": [{}], "gpu": [{"a100": 2}, {"": 4}]}
    ps = profiles() + [Profile(name="a100x4", display_name="4 A100", partition="gpu", walltime="1:00:00",
                               gpus_per_node=4, gpu_type="a100"),
                       Profile(name="cpu-gpu", display_name="GPU on cpu", partition="cpu", walltime="1:00:00",
                               gpus_per_node=1)]
    why = unavailable_reasons(ps, parts)
    assert "cpu-2h" not in why and "gpu1-2h" not in why and "node4gpu" not in why  # the controls: given
    assert why["a100x4"] == "no node of partition 'gpu' has 4 a100 GPUs"
    assert why["cpu-gpu"] == "no node of partition 'cpu' has 1 GPU"
    with pytest.raises(OptionError, match=r"\(no node of partition 'cpu' has 1 GPU\); choose another"):
        resolve_options({"profile": "cpu-gpu"}, ps, "cpu-2h", unavailable=why)
    assert "not available on this cluster: no node of partition &#x27;cpu&#x27; has 1 GPU" in \
        options_form_html(ps, "cpu-2h", why)


def test_form_data_becomes_options():
    assert options_from_form({"profile": ["gpu1-2h"], "walltime": [""], "_xsrf": ["x"]}) == {"profile": "gpu1-2h"}
    assert options_from_form({"profile": ["cpu-2h"], "walltime": ["1:00:00"]}) == \
        {"profile": "cpu-2h", "walltime": "1:00:00"}


def test_form_lists_profiles_escaped_and_disables_unavailable():
    ps = profiles() + [Profile(name="evil", display_name="<script>x</script>", partition="cpu",
                               walltime="1:00:00")]
    html = options_form_html(ps, "cpu-2h", unavailable={"node4gpu"})
    assert html.count('type="radio"') == 5
    assert 'value="cpu-2h" checked' in html
    assert 'value="node4gpu" disabled' in html and "not available on this cluster" in html
    assert "<script>" not in html and "&lt;script&gt;" in html


def request(name="node4gpu", **course):
    return resolve_options({"profile": name}, profiles(**course), "cpu-2h")


def render(req, **kw):
    args = dict(username="alice", job_name="jupyter-alice", log_path="/home/alice/.scalelab/jobs/jupyter-%j.log",
                workdir="/home/alice", export_vars=["PATH", "JUPYTERHUB_API_TOKEN"],
                cmd=["/venv/bin/batchspawner-singleuser", "/venv/bin/jupyterhub-singleuser"])
    args.update(kw)
    return render_batch_script(req, **args)


def sbatch_lines(script):
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_batch_script_has_the_profile_resources_and_the_class_reservation():
    lines = sbatch_lines(render(request(account="proj", reservation="class")))
    assert lines == [
        "#SBATCH --job-name=jupyter-alice",
        "#SBATCH --output=/home/alice/.scalelab/jobs/jupyter-%j.log",
        "#SBATCH --chdir=/home/alice",
        "#SBATCH --export=JUPYTERHUB_API_TOKEN,PATH",
        "#SBATCH --partition=gpu",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=2:00:00",
        "#SBATCH --mem=128G",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --account=proj",
        "#SBATCH --reservation=class",
    ]


def test_batch_script_runs_the_server_with_exec_and_the_prologues():
    p = Profile(name="x", display_name="X", partition="cpu", walltime="1:00:00", gpu_type="a100", gpus_per_node=2,
                prologue="module load cuda")
    text = render(resolve_options({}, [p]), prologue="echo course", provision_cmd=["/venv/bin/python", "-m", "p"])
    assert "#SBATCH --gres=gpu:a100:2" in text
    assert text.index("echo course") < text.index("module load cuda") < text.index("/venv/bin/python -m p")
    assert text.rstrip().endswith("exec /venv/bin/batchspawner-singleuser /venv/bin/jupyterhub-singleuser")
    assert "#SBATCH --reservation" not in text and "#SBATCH --mem" not in text


def test_batch_script_quotes_the_command():
    text = render(request(), cmd=["/v/bin/x", "--arg=a b; rm -rf /"])
    assert "exec /v/bin/x '--arg=a b; rm -rf /'" in text


@pytest.mark.parametrize("field, value", [("job_name", "a\n#SBATCH --x"), ("workdir", "/home/a b"),
                                          ("log_path", "/x\n#SBATCH --y"), ("username", "a;b")])
def test_batch_script_refuses_values_that_would_add_lines(field, value):
    with pytest.raises(ValueError, match="refusing"):
        render(request(), **{field: value})


def test_batch_script_refuses_a_tampered_profile():
    p = Profile(name="x", display_name="X", partition="cpu\n#SBATCH --exclusive", walltime="1:00:00")
    with pytest.raises(ValueError, match="partition"):
        render(resolve_options({}, [p]))


# -- what the form and the pending page say about the queue (scalelab.hub.queue): counts and times only ---------

# `sinfo -h -N -O queue.SINFO_FIELDS` on the 2-node namespace cluster (2 stand-in GPUs per node, gres.conf File=):
# node1 runs a 1-GPU job, node2 is in a whole-node reservation and idle; plus a drained node and a DOWN partition.
SINFO_2NODES = """\
node1|cpu|up|mixed|gpu:2|gpu:1(IDX:0)|1/3/0/4|
node2|cpu|up|reserved|gpu:2|gpu:0|0/4/0/4|
node1|gpu|up|mixed|gpu:2|gpu:1(IDX:0)|1/3/0/4|
node2|gpu|up|reserved|gpu:2|gpu:0|0/4/0/4|
node3|gpu|up|drained|gpu:a100:4(S:0-1)|gpu:a100:0|0/0/8/8|
node1|closed|down|mixed|gpu:2|gpu:1(IDX:0)|1/3/0/4|
"""
RESERVATIONS = (
    "ReservationName=class StartTime=2026-11-27T08:00:00 EndTime=2026-11-27T10:00:00 Duration=02:00:00 "
    "Nodes=node[2-3] NodeCnt=2 CoreCnt=12 Features=(null) PartitionName=gpu Flags=SPEC_NODES "
    "TRES=cpu=12,gres/gpu=6 Users=(null) Groups=(null) Accounts=course State=ACTIVE BurstBuffer=(null)\n"
    "ReservationName=later StartTime=2026-11-28T08:00:00 EndTime=2026-11-28T10:00:00 Duration=02:00:00 "
    "Nodes=node1 NodeCnt=1 CoreCnt=4 Features=(null) PartitionName=(null) Flags= TRES=cpu=4 Users=root "
    "Groups=(null) Accounts=(null) State=INACTIVE BurstBuffer=(null)\n")


def test_partition_counts_free_nodes_cpus_and_gpus_of_usable_nodes_only():
    from scalelab.hub.queue import parse_sinfo, partition_free
    parts = parse_sinfo(SINFO_2NODES + "garbage line\n")
    assert sorted(parts) == ["closed", "cpu", "gpu"]
    # node2 is held by a reservation (free only to it), node3 drained: neither counts as free now
    assert partition_free(parts["gpu"]).text() == "0/3 nodes, 3/16 CPUs, 1/8 GPUs free"
    assert partition_free(parts["cpu"]).text() == "0/2 nodes, 3/8 CPUs, 1/4 GPUs free"
    assert partition_free(parts["closed"]).text() == "0/1 nodes, 0/4 CPUs, 0/2 GPUs free"


def test_reservation_counts_what_its_nodes_have_free_up_to_its_size():
    from scalelab.hub.queue import expand_hostlist, parse_reservations, parse_sinfo, reservation_free
    assert expand_hostlist("n[01-03,7],gpu1,x[2]") == ["n01", "n02", "n03", "n7", "gpu1", "x2"]
    assert expand_hostlist("(null)") == []
    resv = parse_reservations(RESERVATIONS)
    assert resv["class"].nodes == ("node2", "node3") and (resv["class"].cpus, resv["class"].gpus) == (12, 6)
    parts = parse_sinfo(SINFO_2NODES)
    # node2 idle in the reservation (4 CPUs, 2 GPUs); node3 is drained; totals are the reservation's own
    assert reservation_free(resv["class"], parts["gpu"]).text() == "1/2 nodes, 4/12 CPUs, 2/6 GPUs free"
    assert not resv["later"].active
    assert reservation_free(resv["later"], parts["cpu"]).text() == "0/1 nodes, 0/4 CPUs, 0/2 GPUs free"
    assert parse_reservations("No reservations in the system") == {}


def test_profile_lines_say_now_and_in_the_reservation_or_why_not():
    from scalelab.hub.queue import Snapshot, parse_reservations, parse_sinfo
    snap = Snapshot(taken=0, partitions=parse_sinfo(SINFO_2NODES), reservations=parse_reservations(RESERVATIONS))
    assert snap.profile_lines("gpu", "class") == ["Free now on partition gpu: 0/3 nodes, 3/16 CPUs, 1/8 GPUs free",
                                                  "In reservation class: 1/2 nodes, 4/12 CPUs, 2/6 GPUs free"]
    assert snap.profile_lines("cpu", "later")[1] == ("In reservation later: 0/1 nodes, 0/4 CPUs, 0/2 GPUs free "
                                                     "(it starts 2026-11-28T08:00:00)")
    assert snap.profile_lines("closed", "")[0].endswith("(the partition is not taking jobs)")
    assert snap.profile_lines("nope", "gone") == ["Free now on partition nope: no nodes (partition not found)",
                                                  "In reservation gone: not found on the cluster"]
    assert Snapshot(taken=0, partitions=None, error="x").profile_lines("gpu", "class") == \
        ["Free now: unknown (Slurm did not answer)"]
    assert Snapshot(taken=0, partitions=parse_sinfo(SINFO_2NODES), reservations=None).profile_lines(
        "gpu", "class")[1] == "In reservation class: unknown (Slurm did not answer)"


def test_pending_place_is_by_priority_then_submission_within_the_partition():
    from scalelab.hub.queue import pending_place
    text = ("31|gpu|100|2026-11-27T09:00:00\n30|gpu|100|N/A\n29|cpu|500|N/A\n33|gpu,cpu|900|N/A\n"
            "32|gpu|50|2026-11-27T11:00:00\n")
    place = pending_place(text, "31")
    assert (place.position, place.waiting, place.partition, place.start) == (3, 4, "gpu", "2026-11-27T09:00:00")
    assert place.text() == "position 3 of 4 waiting in partition gpu; expected start 2026-11-27T09:00:00"
    assert pending_place(text, "30").text() == \
        "position 2 of 4 waiting in partition gpu; no expected start from Slurm yet"
    assert pending_place(text, "29").position == 2  # job 33 (also in cpu, higher priority) is ahead
    assert pending_place(text, "99") is None


def test_form_shows_queue_lines_escaped_under_each_profile():
    ps = profiles()
    lines = {"cpu-2h": ["Free now on partition cpu: 1/1 nodes, 2/2 CPUs free (no GPUs)",
                        "In reservation r<script>alert(1)</script>: unknown"]}
    html = options_form_html(ps, "cpu-2h", queue=lines, queue_time="04:05:06")
    assert "Free now on partition cpu: 1/1 nodes, 2/2 CPUs free (no GPUs)" in html
    assert "<script>" not in html and "r&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "as Slurm counted them at 04:05:06" in html
    assert "Free now" not in options_form_html(ps, "cpu-2h")  # no view (local mode): nothing said


def test_the_snapshot_keeps_gpu_types_for_the_unavailable_check():
    from scalelab.hub.options import partition_gpus, unavailable_reasons
    from scalelab.hub.queue import Snapshot, parse_sinfo
    snap = Snapshot(taken=0, partitions=parse_sinfo(SINFO_2NODES))
    parts = partition_gpus(snap.gres_lines())
    assert parts["gpu"] == [{"": 2}, {"": 2}, {"a100": 4}]
    a100 = Profile(name="a100x4", display_name="4 A100", partition="gpu", walltime="1:00:00", gpus_per_node=4,
                   gpu_type="a100")
    v100 = Profile(name="v100", display_name="V100", partition="gpu", walltime="1:00:00", gpus_per_node=1,
                   gpu_type="v100")
    assert unavailable_reasons([a100, v100], parts) == {"v100": "no node of partition 'gpu' has 1 v100 GPU"}


def test_a_core_count_reservation_holds_no_gpus_unless_its_tres_names_them():
    from scalelab.hub.queue import parse_reservations, parse_sinfo, reservation_free
    resv = parse_reservations(
        "ReservationName=few StartTime=2026-11-27T08:00:00 EndTime=2026-11-27T10:00:00 Duration=02:00:00 "
        "Nodes=node1 NodeCnt=1 CoreCnt=2 Features=(null) PartitionName=gpu Flags=SPEC_NODES TRES=cpu=2 "
        "Users=root Groups=(null) Accounts=(null) State=ACTIVE BurstBuffer=(null)")
    assert reservation_free(resv["few"], parse_sinfo(SINFO_2NODES)["gpu"]).text() == \
        "0/1 nodes, 2/2 CPUs free (no GPUs)"
