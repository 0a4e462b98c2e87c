"""Model architectures; ``registry`` maps HF architecture names to classes."""
