"""PASS_TO_PASS (hidden from the agent; placed at /tests after its phase)."""

import unittest

import inflection


class Test(unittest.TestCase):
    def test_0(self):
        self.assertEqual(inflection.ordinalize(1), '1st')

    def test_1(self):
        self.assertEqual(inflection.ordinalize(2), '2nd')

    def test_2(self):
        self.assertEqual(inflection.ordinalize(3), '3rd')

    def test_3(self):
        self.assertEqual(inflection.ordinalize(11), '11th')

    def test_4(self):
        self.assertEqual(inflection.ordinalize(21), '21st')

    def test_5(self):
        self.assertEqual(inflection.ordinalize(1002), '1002nd')
