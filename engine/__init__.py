"""H3Forge engine: MiniMax-H3 and SeedVR2 serving. Heavy imports live in submodules."""
