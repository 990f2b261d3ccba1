"""FAIL_TO_PASS (hidden from the agent; placed at /tests after its phase)."""

import unittest

import inflection


class Test(unittest.TestCase):
    def test_0(self):
        self.assertEqual(inflection.parameterize('Hello, World!'), 'hello-world')

    def test_1(self):
        self.assertEqual(inflection.parameterize('Trailing bad characters!@#'), 'trailing-bad-characters')

    def test_2(self):
        self.assertEqual(inflection.parameterize('Trailing bad characters!@#', '_'), 'trailing_bad_characters')
