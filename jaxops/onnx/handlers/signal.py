"""Signal processing: DFT, STFT, Hann/Hamming/Blackman windows."""
from __future__ import annotations

import functools

import numpy as np
import jax.numpy as jnp

from ..registry import handler
from ._precise import in_float64
from ._util import np_dtype, norm_axis


def _complex(x):
    """[..., 1] real or [..., 2] (re, im) -> complex [...] (complex64 unless x is float64)."""
    ct = jnp.complex128 if x.dtype == jnp.float64 else jnp.complex64
    if x.shape[-1] == 1:
        return x[..., 0].astype(ct)
    return x[..., 0].astype(ct) + 1j * x[..., 1].astype(ct)


def _split(z, dtype):
    return jnp.stack([jnp.real(z), jnp.imag(z)], axis=-1).astype(dtype)


def _dft(x, length, axis, inverse, onesided):
    axis = norm_axis(axis, x.ndim)
    if axis == x.ndim - 1:
        raise ValueError("DFT: axis must not be the last (real/imaginary) dimension")
    if length is None:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    z = _complex(x)
    # FFTs in float64 (x64 on or off): a float32 FFT is ~1e-6 off where the exact value is 0,
    # and the ONNX tests check those to 1e-7
    fft = in_float64(functools.partial(
        jnp.fft.irfft if inverse and onesided else jnp.fft.ifft if inverse else jnp.fft.fft,
        n=length, axis=axis))
    if inverse:
        if onesided:
            return fft(z)[..., None].astype(x.dtype)
        return _split(fft(z), x.dtype)
    y = fft(z)
    if onesided:
        y = jnp.take(y, jnp.arange(length // 2 + 1), axis=axis)
    return _split(y, x.dtype)


def _scalar(ctx, v, what):
    return None if v is None else int(np.asarray(ctx.static(v, what)).reshape(-1)[0])


@handler("DFT", since=17)
def dft_17(ctx, x, dft_length=None, *, axis=1, inverse=0, onesided=0):
    return _dft(x, _scalar(ctx, dft_length, "dft_length"), axis, inverse, onesided)


@handler("DFT", since=20)
def dft_20(ctx, x, dft_length=None, axis=None, *, inverse=0, onesided=0):
    a = -2 if axis is None else _scalar(ctx, axis, "axis")
    return _dft(x, _scalar(ctx, dft_length, "dft_length"), a, inverse, onesided)


@handler("STFT", since=17)
def stft(ctx, signal, frame_step, window=None, frame_length=None, *, onesided=1):
    step = _scalar(ctx, frame_step, "frame_step")
    n = _scalar(ctx, frame_length, "frame_length") if frame_length is not None else window.shape[0]
    length = signal.shape[1]
    frames = 1 + (length - n) // step
    idx = np.arange(frames)[:, None] * step + np.arange(n)[None, :]
    z = _complex(signal)[:, idx]  # [B, frames, n]
    if window is None:
        y = in_float64(lambda z: jnp.fft.fft(z, axis=-1))(z)
    else:
        y = in_float64(lambda z, w: jnp.fft.fft(z * w, axis=-1))(z, window)
    if onesided:
        y = y[..., : n // 2 + 1]
    return _split(y, signal.dtype)


def _window(ctx, size, periodic, output_datatype, coeffs):
    n = _scalar(ctx, size, "size")
    ctx.check_size((n,), np.float64)
    denom = n if periodic else n - 1
    k = np.arange(n)
    w = sum(c * np.cos(2 * np.pi * j * k / denom) for j, c in enumerate(coeffs))
    return w.astype(np_dtype(output_datatype))


@handler("HannWindow", since=17)
def hann_window(ctx, size, *, output_datatype=1, periodic=1):
    return _window(ctx, size, periodic, output_datatype, [0.5, -0.5])


@handler("HammingWindow", since=17)
def hamming_window(ctx, size, *, output_datatype=1, periodic=1):
    return _window(ctx, size, periodic, output_datatype, [25 / 46, -(1 - 25 / 46)])


@handler("BlackmanWindow", since=17)
def blackman_window(ctx, size, *, output_datatype=1, periodic=1):
    return _window(ctx, size, periodic, output_datatype, [0.42, -0.5, 0.08])


@handler("MelWeightMatrix", since=17)
def mel_weight_matrix(ctx, num_mel_bins, dft_length, sample_rate, lower_edge_hertz,
                      upper_edge_hertz, *, output_datatype=1):
    """Static [dft_length // 2 + 1, num_mel_bins] triangular filters (HTK mel scale), with the
    ONNX reference's bin placement (mel step = range / (num_mel_bins + 2))."""
    mels, n_fft, rate = (_scalar(ctx, v, "MelWeightMatrix size") for v in
                         (num_mel_bins, dft_length, sample_rate))
    ctx.check_size((n_fft // 2 + 1, mels), np.float64)
    lo, hi = (float(np.asarray(ctx.static(v, "edge frequency")).reshape(-1)[0])
              for v in (lower_edge_hertz, upper_edge_hertz))
    to_mel = lambda f: 2595 * np.log10(1 + f / 700)
    points = np.arange(mels + 2) * (to_mel(hi) - to_mel(lo)) / (mels + 2) + to_mel(lo)
    hz = 700 * (10 ** (points / 2595) - 1)
    bins = (((n_fft + 1) * hz) // rate).astype(int)
    out = np.zeros((n_fft // 2 + 1, mels))
    for i in range(mels):
        left, centre, right = bins[i], bins[i + 1], bins[i + 2]
        if centre == left:
            out[centre, i] = 1
        else:
            j = np.arange(left, centre + 1)
            out[j, i] = (j - left) / (centre - left)
        if right > centre:
            j = np.arange(centre, right)
            out[j, i] = (right - j) / (right - centre)
    return out.astype(np_dtype(output_datatype))
