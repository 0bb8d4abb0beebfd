"""agl_lab: step the agentic GRPO loop cell by cell and look at everything.

    from agl_lab import Trainer
    trainer = Trainer.from_config("configs/cpu_tiny.yaml")
    ro = trainer.rollout(); b = trainer.build_batch(); u = trainer.update()

Importing agl_lab is cheap (no torch, verl or web stack); `agl_lab.Trainer` imports the trainer
on first use. The `per_rollout_mean` policy loss is registered in verl's registry when
`agl_lab.algorithms` is imported (the Trainer and both engines import it).
"""

from __future__ import annotations

__version__ = "0.1.0"

from agl_lab import quiet as _quiet

_quiet.install()  # verl's CPU noise (optional back-ends, no accelerator): see agl_lab.quiet


def __getattr__(name: str):
    # Lazy public API: `import agl_lab` stays cheap (no torch/verl import) for the CLI and agents.
    if name == "Trainer":
        from agl_lab.trainer import Trainer

        return Trainer
    if name in ("compare", "plot_compare"):  # runs side by side (agl_lab.comparison)
        from agl_lab import comparison as _comparison

        return getattr(_comparison, name)
    if name == "evaluate":  # pass@k of a model, checkpoint or run (agl_lab.evaluation)
        from agl_lab.evaluation import evaluate

        return evaluate
    raise AttributeError(f"module 'agl_lab' has no attribute {name!r}")
