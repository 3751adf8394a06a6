"""Edit-mask reduction to the latent cell and token grids, checked on hand-computed cases."""

import pytest
import torch

from engine.models.h3 import mask as M


def test_latent_frame_spans_follow_the_17n_plus_5_rule():
    assert M.latent_frame_spans(22) == [(0, 1), (1, 5), (5, 9), (9, 13), (13, 17), (17, 18), (18, 22)]
    spans = M.latent_frame_spans(124)
    assert len(spans) == 37 and spans[-1][1] == 124
    with pytest.raises(ValueError, match="17n"):
        M.latent_frame_spans(23)


def test_one_pixel_regenerates_its_cell_and_token():
    m = torch.zeros(22, 64, 96)  # odd token grid: 4 x 6 cells -> 2 x 3 tokens
    m[6, 17, 33] = 1.0  # pixel frame 6 -> latent frame 2; cell (1, 2); token (0, 1)
    cells = M.cell_mask(m, 22, 64, 96)
    assert cells.shape == (7, 4, 6)
    expected = torch.zeros(7, 4, 6)
    expected[2, 1, 2] = 1
    assert torch.equal(cells, expected)
    tokens = M.token_mask(cells).view(7, 2, 3)
    assert tokens.sum() == 1 and tokens[2, 0, 1] == 1


def test_first_frame_only_touches_latent_zero_and_fractions_quantise_up():
    m = torch.zeros(22, 32, 32)
    m[0] = 0.3  # only the first pixel frame
    m[17, :16, :16] = 0.501  # latent 5 covers exactly frame 17
    cells = M.cell_mask(m, 22, 32, 32)
    assert torch.allclose(cells[0], torch.full((2, 2), 0.3))
    assert cells[1:5].sum() == 0 and cells[5, 0, 0] == pytest.approx(0.501) and cells[5].sum() == pytest.approx(0.501)
    tokens = M.token_mask(cells).view(7, 1, 1)
    assert tokens[0, 0, 0] == 77 / 256  # ceil(0.3 * 256) / 256
    assert tokens[5, 0, 0] == 129 / 256


def test_2d_masks_broadcast_and_short_masks_repeat_their_last_frame():
    m2 = torch.zeros(32, 64)
    m2[:, 40:] = 1
    cells = M.cell_mask(m2, 22, 32, 64)
    assert torch.equal(cells, torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(7, 2, 4))
    short = torch.zeros(18, 32, 64)
    short[17] = 1  # frames 18..21 repeat this one -> latents 5 and 6
    assert M.cell_mask(short, 22, 32, 64)[:, 0, 0].tolist() == [0, 0, 0, 0, 0, 1, 1]


def test_mask_at_another_resolution_is_resampled_onto_the_canvas():
    m = torch.zeros(16, 32)
    m[:, 16:] = 1
    cells = M.cell_mask(m, 22, 64, 128)
    assert cells.shape == (7, 4, 8) and cells[:, :, :4].sum() == 0 and (cells[:, :, 4:] == 1).all()


def test_restore_rows_match_the_packed_feature_order():
    cells = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4) / 16
    rows = M.restore_rows(cells, channels=3)
    assert rows.shape == (2 * 1 * 2, 12)
    # row (t=1, i=0, j=1), feature (c=2, ph=1, pw=0) -> cell (1, 1, 2)
    assert rows[1 * 2 + 1, 2 * 4 + 1 * 2 + 0] == cells[1, 1, 2]


def test_a_wire_mask_in_uint8_gives_the_float_masks_canvas_a_few_frames_at_a_time(monkeypatch):
    """The engine keeps a sent uint8 mask as it came and converts it after resizing, a few frames at a time; the
    canvas is the one its float 0..1 form gives in one go (shrunk by area, grown by nearest, padded to 17n + 5)."""
    wire = torch.randint(0, 256, (20, 48, 72), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = {size: M.canvas_mask(wire.float() / 255, 22, *size) for size in ((32, 48), (64, 96), (48, 72))}
    monkeypatch.setattr(M, "CHUNK_ELEMENTS", 3 * 48 * 72)  # three frames a chunk
    for size, canvas in expected.items():
        assert canvas.shape == (22, *size) and torch.equal(canvas[20:], canvas[19:20].expand(2, -1, -1))
        assert torch.equal(M.canvas_mask(wire, 22, *size), canvas)
    assert torch.equal(M.canvas_mask(wire[3], 22, 32, 48), expected[32, 48][3].expand(22, -1, -1))


@pytest.mark.parametrize("bad, message", [
    (torch.full((32, 32), float("nan")), "NaN"),
    (torch.full((32, 32), 2.0), "from 0 .keep. to 1"),
    (torch.zeros(30, 32, 32), "has 30 frames but the video has 22"),
    (torch.zeros(2, 2, 32, 32), "2-D"),
])
def test_bad_masks_are_refused_clearly(bad, message):
    with pytest.raises(M.MaskError, match=message):
        M.cell_mask(bad, 22, 32, 32)


def test_audio_rows():
    assert M.audio_rows(0.5, 3).tolist() == [0.5] * 6
    assert M.audio_rows(torch.tensor([0.0, 1.0, 0.0]), 3).tolist() == [0, 1, 0, 0, 1, 0]
    with pytest.raises(M.MaskError, match="40 values a second"):
        M.audio_rows(torch.zeros(5), 3)
