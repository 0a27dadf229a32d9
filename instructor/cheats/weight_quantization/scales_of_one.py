"""channel_scales skips the scaling: ones for every channel, right for alpha 0 only."""
TARGETS = ["test_channel_scales_are_awqs"]


def channel_scales(magnitude, alpha):
    return np.ones(len(magnitude), np.float32)
