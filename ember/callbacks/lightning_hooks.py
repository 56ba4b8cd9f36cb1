"""Lightning hook names that ember does not call: what each meant there and what to write in ember instead.

`check_hook_names` (callback_list.py) rejects any ``on_*`` method that is not an ember hook, so a misspelt
hook cannot be silently ignored. For the names below, which Lightning users write from habit, the error
says what the hook meant in Lightning and names the ember way to get the same effect.
"""

from __future__ import annotations

#: name -> (what Lightning does with it, what to do in ember)
LIGHTNING_ONLY: dict[str, tuple[str, str]] = {
    "on_validation_model_zero_grad": (
        "Lightning calls it inside fit before validation to release gradients",
        "ember releases gradients after every optimizer step already; put anything else in on_validation_start",
    ),
    "on_epoch_start": (
        "Lightning 1.x called it at the start of every training, validation and test epoch (removed in 2.0)",
        "use on_train_epoch_start, on_validation_epoch_start or on_test_epoch_start",
    ),
    "on_epoch_end": (
        "Lightning 1.x called it at the end of every training, validation and test epoch (removed in 2.0)",
        "use on_train_epoch_end, on_validation_epoch_end or on_test_epoch_end",
    ),
    "on_batch_start": (
        "Lightning 1.x called it before every training batch (removed in 2.0)",
        "use on_train_batch_start(batch, batch_idx)",
    ),
    "on_batch_end": (
        "Lightning 1.x called it after every training batch (removed in 2.0)",
        "use on_train_batch_end(outputs, batch, batch_idx)",
    ),
    **dict.fromkeys(
        ("on_pretrain_routine_start", "on_pretrain_routine_end"),
        ("Lightning 1.x called it before the sanity check (removed in 2.0)", "use on_fit_start"),
    ),
    "on_keyboard_interrupt": (
        "Lightning 1.x called it on Ctrl-C (removed in 2.0)",
        "use on_exception and check isinstance(exception, KeyboardInterrupt)",
    ),
    **dict.fromkeys(
        ("on_init_start", "on_init_end"),
        ("Lightning 1.x called it while the Trainer was built (removed in 2.0)", "use __init__"),
    ),
    "on_configure_sharded_model": (
        "Lightning 1.x called it to build layers lazily for sharded training",
        "build the layers in __init__; FSDP2 shards them (docs/scaling.md)",
    ),
    "on_before_accelerator_backend_setup": (
        "Lightning 1.x called it before the accelerator was set up",
        "use setup(stage)",
    ),
    "on_hpc_save": ("Lightning 1.x called it when saving a SLURM requeue checkpoint", "use on_save_checkpoint"),
    "on_hpc_load": ("Lightning 1.x called it when loading a SLURM requeue checkpoint", "use on_load_checkpoint"),
    **{
        f"on_{stage}_dataloader": (f"Lightning 1.x called it before {stage}_dataloader()", f"use {stage}_dataloader()")
        for stage in ("train", "val", "test", "predict")
    },
}

#: LightningModule methods (not ``on_*``) that Lightning calls and ember does not: a module defining one is refused.
MODULE_METHODS: dict[str, tuple[str, str]] = {
    "optimizer_step": (
        "Lightning calls it to step the optimizer, and an override changes how",
        "ember's step is not overridable: use on_before_optimizer_step, or manual optimization "
        "(automatic_optimization = False) to step yourself",
    ),
    "optimizer_zero_grad": (
        "Lightning calls it to clear gradients",
        "use on_before_zero_grad, or manual optimization to clear them yourself",
    ),
    "backward": (
        "Lightning calls it to run loss.backward()",
        "use on_before_backward / on_after_backward, or manual optimization with self.manual_backward",
    ),
    "lr_scheduler_step": (
        "Lightning calls it to step a scheduler that is not a torch.optim scheduler",
        "return torch.optim.lr_scheduler schedulers, or step yours in a hook (e.g. on_train_epoch_end)",
    ),
    "configure_gradient_clipping": (
        "Lightning calls it to clip gradients before each optimizer step",
        "use Trainer(gradient_clip_val=...), or clip in on_before_optimizer_step",
    ),
    "configure_callbacks": (
        "Lightning adds the callbacks it returns to the Trainer's",
        "pass them to Trainer(callbacks=[...])",
    ),
    "configure_sharded_model": (
        "Lightning 1.x called it to build layers for sharded training (renamed configure_model in 2.0)",
        "rename it configure_model",
    ),
}

#: `MODULE_METHODS` Lightning calls under automatic optimization only. Under manual optimization
#: (``automatic_optimization = False``) neither framework calls them, so a module may define them there (Lightning's
#: examples keep an ``optimizer_step`` override that never runs); ``backward`` is not among them: Lightning's
#: ``manual_backward`` calls it.
AUTOMATIC_ONLY = frozenset(
    {"optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping"}
)

#: Hooks Lightning calls on the module (or DataModule) only; a callback defining one gets this hint.
MODULE_ONLY = (
    "on_before_batch_transfer",
    "on_after_batch_transfer",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_model_eval",
    "on_test_model_train",
    "on_predict_model_eval",
)


def explain(owner: str, name: str, is_callback: bool) -> str | None:
    """The error for `owner`.`name` when it is a Lightning hook ember does not call there; None otherwise."""
    if name in LIGHTNING_ONLY or (not is_callback and name in MODULE_METHODS):
        meaning, instead = LIGHTNING_ONLY.get(name) or MODULE_METHODS[name]
        return f"{owner}.{name} is a Lightning hook that ember does not call ({meaning}); {instead}"
    if is_callback and name in MODULE_ONLY:
        return (
            f"{owner}.{name} is a hook of the TrainingModule (and, for batch transfer, the DataModule), not of "
            "callbacks, in Lightning and in ember; define it on the module"
        )
    return None
