"""FAIL_TO_PASS (hidden from the agent; placed at /tests after its phase)."""

import unittest

import inflection


class Test(unittest.TestCase):
    def test_0(self):
        self.assertEqual(inflection.underscore('HTTPServer'), 'http_server')

    def test_1(self):
        self.assertEqual(inflection.underscore('IOError'), 'io_error')

    def test_2(self):
        self.assertEqual(inflection.tableize('XMLRecord'), 'xml_records')
