"""Frozen route plans: the calibration engine, and the plans that prove, time and freeze one route
per declared shape (dense Q4_0, dense and quantised expert-ID). Built on ops."""
