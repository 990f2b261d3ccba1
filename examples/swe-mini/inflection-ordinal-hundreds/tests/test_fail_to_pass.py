"""FAIL_TO_PASS (hidden from the agent; placed at /tests after its phase)."""

import unittest

import inflection


class Test(unittest.TestCase):
    def test_0(self):
        self.assertEqual(inflection.ordinalize(111), '111th')

    def test_1(self):
        self.assertEqual(inflection.ordinalize(1012), '1012th')

    def test_2(self):
        self.assertEqual(inflection.ordinalize(-113), '-113th')
