"""xfam's contract tests for the plugin's components: one line per component (by name or by class)."""

from xfam_example_plugin import ClippedBiasEncoding

from xfam.testing import contract_tests

TestClippedBias = contract_tests("pos", ClippedBiasEncoding)
TestTalkingHeads = contract_tests("attention", "talking_heads")
