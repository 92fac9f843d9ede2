"""The one cost seam: `base` (protocol, batch), `analytic` (roofline), `profile` (measured)."""
