"""What runs a training job whatever the modality: processes, asynchrony, checkpoints, run state,
logging and plots, guarded workers for user code (rewards, envs), builders of the generic parts.
Nothing here imports modality code (a layering test checks it)."""
