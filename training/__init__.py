"""Training the embedded default (issue 18): the toy world it learns from and the scores that judge its output.

toy_scene  the vocabulary, `Scene`, `sample_scene(seed)` and each object's path
toy_world  `render(scene)` -> frames, stereo audio, caption and per-frame ground truth
toy_sound  hums, clicks and rain from plain arrays
captions   the caption grammar: `caption(scene)`, `parse_caption(text)`
scoring    `score_clip(frames, audio, caption or scene)` from decoded frames and audio alone
quality    PSNR, SSIM, CIE Lab and ΔE76
"""
