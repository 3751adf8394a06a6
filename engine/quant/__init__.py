"""Quantized linear layers that replace a plain model's nn.Linear modules (gpt-fast style): weights run as stored."""
