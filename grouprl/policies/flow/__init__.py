"""Image / video policies: flow-matching and DDPM denoisers as Gaussian-step policies."""
