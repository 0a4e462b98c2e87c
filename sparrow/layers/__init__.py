"""Model building blocks shared by every architecture: linear, attention, MoE, router, norms, activations."""
