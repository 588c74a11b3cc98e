"""Production hardening: what makes the training loop safe on rented GPUs. Skip it on a first read.

The training scripts and trainer_utils.py call each module here through one name. No number of a step is
computed here (the script and trainer_utils.py compute them); what is decided here is around the steps: the
weights a run starts from (from_weight.py), when it stops, which checkpoint a resume reads, and after a rollback
(--on_anomaly rollback) the LR's scale and the windows left out. Where the save and the resume go on from
trainer_utils.py, a learner who wants their files' safety reads checkpoint_io.py next.

    checkpoint_io.py       checkpoints: hash manifest, resume link, rotation, fallback to an older one
    durable_files.py       what checkpoint_io.py builds on: hash, manifest, weights_only load (the temp file,
                           fsync and rename: output_paths.py, beside trainer/)
    background_save.py     the copy to CPU memory, then the write in a thread while training goes on
    save_on_ranks.py       lm_checkpoint's save on every rank: RNG states gathered, a failure raised on all
    sharding.py            --parallel fsdp: each rank keeps a slice, and saves it
    sharded_checkpoint.py  a sharded checkpoint's folder: its manifest check, its safe reading, consolidation
    anomaly_policy.py      --on_anomaly, between steps: verdicts, rollback, the windows left out
    anomaly.py             the guard itself: NaN, spikes, explosions, plateaus; warn, stop, rollback
    tracking.py            console, metrics and status files, wandb, SwanLab, validation
    run_lock.py            one trainer per directory; stopping.py, SIGTERM and Ctrl-C
    resume_checks.py       a resume that changed the model, data or settings is refused
    operator_flags.py      the flags of all of the above; flag_checks.py, every flag's range and kind
    process_group.py       joining torchrun's process group; process_exit.py, how a process ends (exit 2, 3, 4)
    from_weight.py         the model from --from_weight's file, its sizes read from it; the frozen base model

Nothing here imports the scripts or trainer_utils.py, and imports between these modules form no circle:
arrows point down only.
"""
