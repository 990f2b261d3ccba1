"""PASS_TO_PASS (hidden from the agent; placed at /tests after its phase)."""

import unittest

import inflection


class Test(unittest.TestCase):
    def test_0(self):
        self.assertEqual(inflection.parameterize('Donald E. Knuth'), 'donald-e-knuth')

    def test_1(self):
        self.assertEqual(inflection.parameterize('Random text with *(bad)* characters'), 'random-text-with-bad-characters')

    def test_2(self):
        self.assertEqual(inflection.parameterize('Allow_Under_Scores'), 'allow_under_scores')

    def test_3(self):
        self.assertEqual(inflection.parameterize('!Leading bad characters'), 'leading-bad-characters')
