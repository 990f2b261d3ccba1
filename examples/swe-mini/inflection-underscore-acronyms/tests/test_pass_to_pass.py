"""PASS_TO_PASS (hidden from the agent; placed at /tests after its phase)."""

import unittest

import inflection


class Test(unittest.TestCase):
    def test_0(self):
        self.assertEqual(inflection.underscore('DeviceType'), 'device_type')

    def test_1(self):
        self.assertEqual(inflection.underscore('Product'), 'product')

    def test_2(self):
        self.assertEqual(inflection.underscore('area51Controller'), 'area51_controller')

    def test_3(self):
        self.assertEqual(inflection.underscore('special-guest'), 'special_guest')
