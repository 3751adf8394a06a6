"""MiniMax-H3: joint audio+video DiT, packed layout, sampler, VAEs, conditioner, loaders."""
