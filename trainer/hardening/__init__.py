"""Production hardening: what makes the training loop safe on rented GPUs. Skip it on a first read.

The two training scripts and trainer_utils.py call each module here through one name, and the
training reads the same without knowing how it works inside:

    checkpoint_io.py       checkpoints: hash manifest, resume link, rotation, fallback to an older one
    durable_files.py       what checkpoint_io.py builds on: temp file, fsync, rename, hash, weights_only load
    background_save.py     the copy to CPU memory, then the write in a thread while training goes on
    save_on_ranks.py       lm_checkpoint's save on every rank: RNG states gathered, a failure raised on all
    rng_state.py           every RNG a process draws from, saved and restored (bit-identical resume)
    sharding.py            --parallel fsdp: each rank keeps a slice, and saves it
    sharded_checkpoint.py  a sharded checkpoint's folder: its manifest check, its safe reading, consolidation
    anomaly_policy.py      --on_anomaly, entered from the loop by three lines: verdicts, rollback, windows to skip
    anomaly.py             the guard itself: NaN, spikes, explosions, plateaus; warn, stop, rollback
    tracking.py            console, metrics and status files, wandb, SwanLab, validation
    run_lock.py            one trainer per directory; stopping.py, SIGTERM and Ctrl-C
    resume_checks.py       a resume that changed the model, data or settings is refused
    operator_flags.py      the flags of all of the above; flag_checks.py, every flag's range and kind
    process_group.py       joining torchrun's process group; process_exit.py, how a process ends (exit 2, 3, 4)
    from_weight.py         the model's sizes from the flags or from --from_weight's file; the frozen base model

Nothing here imports the scripts or trainer_utils.py, and imports between these modules form no circle:
arrows point down only.
"""
