#!/usr/bin/env bash
cd /app
rm temp.txt
