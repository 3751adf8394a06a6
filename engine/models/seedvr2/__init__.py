"""SeedVR2 3B / 7B: NaDiT with window attention, causal 3-D VAE, one-step upscaling pipeline, colour fix, loaders."""
