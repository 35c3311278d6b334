"""Small offline data sources for calibration and evaluation (``from sparsa.data.text import ...``)."""
