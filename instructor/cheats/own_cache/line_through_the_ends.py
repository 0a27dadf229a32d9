"""The line through the first and last points: exact on the public check's noiseless points,
no least squares."""
TARGETS = ["test_fit_line"]


def fit_line(positions, seconds):
    b = (seconds[-1] - seconds[0]) / (positions[-1] - positions[0])
    return float(seconds[0] - b * positions[0]), float(b)
