"""The code behind each lab's measurements: experiments that are not a plain RunSpec training run.

Each module serves one lab and builds its models, data and optimizers with the engine's own builders
(`scalelab.train`, `scalelab.data`), so a measurement here is a measurement of what `launch()` trains:

- `single_device`  (lab 01) throughput split data/compute/full, loader workers, precision, torch.compile,
                   profiler trace, optimisation ladder — in the calling process, one device.
- `collectives`    (lab 02) allreduce time and bandwidth against message size — run with `run_spmd`.
- `ddp_internals`  (lab 02) gradients averaged by hand vs DDP, bucket size, `no_sync` accumulation,
                   replica equality — run with `run_spmd`.
- `horovod_port`   (lab 03) a training function ported to Horovod by the student, and Horovod's timeline.
- `large_batch`    (lab 04) learning-rate scaling and warm-up, large batches with LARS/LAMB, the gradient noise
                   scale, steps to a target and the fitted critical batch, batch growth against decay — in the
                   calling process (the arithmetic of data parallelism on one rank); the schedule exercise's DDP runs.
- `multinode`      (lab 04) 1 node x 2 ranks against 2 nodes x 1 rank (links shaped slow on request), and a batch
                   script of the student's own submitted as an engine run — on a multi-node Slurm.
- `sweep`          (lab 04) weak/strong/batch scaling sweeps: RunSpecs run one after another, speedup and
                   efficiency tables (the ScalingExplorer widget's core).
- `data_pipeline`, `straggler`   (lab 05) file layouts, prefetch, caches, order-aware loading; one slow reader.
- `spread`, `spread_rank`, `read_decode`   (lab 05) the data set spread over the nodes with peer reads
                   (FanStore), a cache shared by a node's ranks and prefetched by the sampler's order (Lobster) — on
                   rank processes (`SpmdPool`) or the namespace cluster's nodes (srun), every read counted by source;
                   read vs decode threads.
- `checkpointing`, `ckpt_timeline`   (lab 06) checkpoint anatomy, sync/async/sharded stalls on a run's clock.
- `model_parallel` (lab 07) tensor parallelism by hand against the serial layers, pipeline bubble (GPipe,
                   1F1B), sharded checkpoints resharded 2 -> 1 -> 2 — run with `run_spmd`.
- `planner`        (lab 07) dp x tp x pp on nodes x GPUs: memory, traffic, links (ParallelismPlanner's core).
- `resilience`     (lab 08) faults and their detection, checkpoint cost and Young's interval against a simulated
                   failure trace, a signal to one rank (preemption), recovery times read off a run's events.
- `interval_runs`  (lab 08) the checkpoint interval on real runs: faults at a Poisson rate, restarts from disk,
                   the useful-work fraction (the student's accounting) against Daly's prediction.
- `resilience_nodes` (lab 08) on the namespace cluster: a rank lost (restart from the node-local tier) vs a whole
                   node lost (restart on the survivor from the shared tier).
- `elastic_horovod` (lab 08) a worker SIGKILLed under Horovod elastic: the survivors' rollback to the last
                   commit, the re-formed world, recovery seconds, the final model against a replay.
- `hpo`            (lab 10) parallel hyperparameter search with optuna: worker processes or one sbatch job per
                   worker sharing a journal file, trials stopped early by the median pruner, steps saved.
- `nas`            (lab 10) architecture search where children start from their parent's weights (Net2Net-style
                   widen/deepen, function-preserving) vs from scratch: accuracy, steps saved, lineage.
- `queue_sim`      (lab 11) a FIFO + backfill queue over a seeded trace; a job chain submitted reactively, with
                   afterok, or at a predicted wait (Mirage-style): idle gaps and queue time.
- `queue_policy`   (lab 11) Mirage in small: a queue-wait model learned from traces, the provisioning policy on it
                   against reactive and average baselines on held-out traces, and the grader's replay.
- `root_cause`     (lab 11) which rank, which phase: 2-rank runs with one rank slowed in its data or compute
                   phase (fault.phase), the student's diagnosis from the events alone scored on held-out cases.
- `profiling`      a profiled run's traces read back: step phases, each collective, the comm/compute overlap per
                   rank, Horovod's timeline, and the Timeline figure (the Timeline widget's core).
- `tensorboard`    a run's event scalars (loss, lr, samples/s, phase times, memory) as TensorBoard files, one
                   TensorBoard run per rank: `export_scalars(run_dir)`; JupyterLab's TensorBoard tile shows them.
- `optimization`   (lab 09) LARS with the student's trust ratio against pytorch-optimizer's, time to accuracy
                   across optimizers and batches, K-FAC/KAISA trajectories and costs on ranks (`run_spmd`).
- `workflows`      (lab 10) a lineage store of models sharing tensors with their parents, continual learning
                   with a rehearsal buffer (the student's keep()) spread over the ranks; (lab 11) a performance
                   model fitted on a grid of engine runs and tested on runs between its points (perf_sweep).
- `online`         (lab 10) a simulation in the training loop: heat-solver ranks publish chunks to a stream folder
                   while a trainer rank trains a surrogate on them, with drift and a rehearsal buffer.
- `plots`          the labs' figures (matplotlib object API, PNG).

Lab-only measurement code lives here and nowhere else: `scalelab.data` and `scalelab.ckpt` are the engine's.
"""
