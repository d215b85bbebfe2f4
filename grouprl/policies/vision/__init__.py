"""Vision-language (image-text-to-text) policies: processing, forward, engines, log-probs."""
