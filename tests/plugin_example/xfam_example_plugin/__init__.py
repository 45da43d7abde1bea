"""An example third-party xfam plugin (the ``xfam.components`` entry point names this package).

Importing it registers its components, written as a component author outside xfam writes them (importing only
``xfam.api``):

    pos=clipped_bias         a learned per-head bias of the clipped relative distance (Shaw et al., 2018; T5)
    attention=talking_heads  talking-heads attention (Shazeer et al., 2020)

Its tests (``tests/``) run xfam's contract test kit on each, one line per component, plus a test of what each
paper promises.
"""

from xfam_example_plugin.clipped_bias import ClippedBias, ClippedBiasEncoding
from xfam_example_plugin.talking_heads import TalkingHeads

__all__ = ["ClippedBias", "ClippedBiasEncoding", "TalkingHeads"]
