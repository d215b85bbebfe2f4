"""Demo building blocks: the synthetic coloured-shapes data set and its tiny flow-matching model."""
